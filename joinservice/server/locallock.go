package server

import "context"

// LocalLock serializes control-plane joins within one process. Use a Lease-backed lock when several
// replicas serve.
type LocalLock struct{ ch chan struct{} }

// NewLocalLock returns an unlocked LocalLock.
func NewLocalLock() *LocalLock { return &LocalLock{ch: make(chan struct{}, 1)} }

// Lock waits for the lock or for ctx's end.
func (l *LocalLock) Lock(ctx context.Context, _ string) (func(), error) {
	select {
	case l.ch <- struct{}{}:
		return func() { <-l.ch }, nil
	case <-ctx.Done():
		return nil, ErrControlPlaneBusy
	}
}
