//go:build cgo && !berthrelease

package tpmsim

import (
	"context"
	"errors"
	"io"
	"sync"

	"github.com/google/go-tpm-tools/simulator"
)

// Simulator is the process-wide reference TPM. Connections from Open are exclusive: a second Open
// waits until the first connection is closed, as with swtpm's single data channel.
type Simulator struct {
	sim  *simulator.Simulator
	busy sync.Mutex
}

// New powers on a fresh simulator. Only one exists per process; New blocks until the previous one
// is closed.
func New() (*Simulator, error) {
	sim, err := simulator.Get()
	if err != nil {
		return nil, err
	}
	return &Simulator{sim: sim}, nil
}

// Open returns an exclusive connection; it has the signature of vtpm.OpenFunc.
func (s *Simulator) Open(context.Context) (io.ReadWriteCloser, error) {
	s.busy.Lock()
	return &handle{s: s}, nil
}

// Reset resets the TPM as a reboot would: PCRs return to their initial values.
func (s *Simulator) Reset() error {
	s.busy.Lock()
	defer s.busy.Unlock()
	return s.sim.Reset()
}

// Close powers the simulator off and frees it for the next New.
func (s *Simulator) Close() error {
	s.busy.Lock()
	defer s.busy.Unlock()
	return s.sim.Close()
}

type handle struct {
	s      *Simulator
	once   sync.Once
	closed bool
}

func (h *handle) Read(p []byte) (int, error) {
	if h.closed {
		return 0, errors.New("simulator connection closed")
	}
	return h.s.sim.Read(p)
}

func (h *handle) Write(p []byte) (int, error) {
	if h.closed {
		return 0, errors.New("simulator connection closed")
	}
	return h.s.sim.Write(p)
}

func (h *handle) Close() error {
	h.once.Do(func() {
		h.closed = true
		h.s.busy.Unlock()
	})
	return nil
}
