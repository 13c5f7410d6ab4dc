// Package tpmsim serves the Microsoft reference TPM 2.0 simulator (through go-tpm-tools, cgo) as a
// vtpm.OpenFunc, for tests. It is compiled only with cgo and without the berthrelease build tag, so
// a release binary (built with -tags berthrelease, or CGO_ENABLED=0) cannot reach it: there New
// returns ErrUnavailable. Only _test files import it.
package tpmsim

import "errors"

// ErrUnavailable is returned by New in builds without the simulator.
var ErrUnavailable = errors.New("TPM simulator not compiled into this binary")
