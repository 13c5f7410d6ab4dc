package server

import "context"

// LocalLock serializes control-plane joins within one process, while each ticket is issued: it
// cannot see a join finish, so Joining frees the slot at once. Use the control-plane slot (SlotLock),
// which holds the slot until the join finished, when several replicas serve or nodes really join.
type LocalLock struct{ ch chan struct{} }

// NewLocalLock returns an unlocked LocalLock.
func NewLocalLock() *LocalLock { return &LocalLock{ch: make(chan struct{}, 1)} }

// Lock waits for the lock or for ctx's end.
func (l *LocalLock) Lock(ctx context.Context, _ string) (ControlPlaneSlot, error) {
	select {
	case l.ch <- struct{}{}:
		return &localSlot{l: l}, nil
	case <-ctx.Done():
		return nil, ErrControlPlaneBusy
	}
}

type localSlot struct {
	l    *LocalLock
	done bool
}

func (s *localSlot) Release() {
	if !s.done {
		s.done = true
		<-s.l.ch
	}
}

func (s *localSlot) Joining(context.Context, string, string) error {
	s.Release()
	return nil
}

func (s *localSlot) WaitedFor() string { return "" }
