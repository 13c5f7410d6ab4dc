//go:build !cgo || berthrelease

package tpmsim

import (
	"context"
	"io"
)

// Simulator is unavailable in this build.
type Simulator struct{}

// New returns ErrUnavailable: this build has no simulator.
func New() (*Simulator, error) { return nil, ErrUnavailable }

// Open returns ErrUnavailable.
func (*Simulator) Open(context.Context) (io.ReadWriteCloser, error) { return nil, ErrUnavailable }

// Reset returns ErrUnavailable.
func (*Simulator) Reset() error { return ErrUnavailable }

// Close does nothing.
func (*Simulator) Close() error { return nil }
