// Package nodelock is the node's one-way lock: the point of no return between initializing a new
// cluster and joining an existing one.
//
// The lock is a state machine with two states and one transition:
//
//	state     | TryLockOnce                     | Locked
//	----------+---------------------------------+-------
//	unlocked  | mark node, → locked, returns ok | false
//	locked    | returns ErrLocked               | true
//
// There is no way back to unlocked. Taking the lock also marks the node as bootstrapped through a
// Marker (the TPM PCR or TDX RTMR lock register in production, a durable file in addition), so a
// rebooted daemon neither initializes nor joins again.
package nodelock

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// ErrLocked is returned by TryLockOnce when another caller already took the lock.
var ErrLocked = errors.New("node lock already taken")

// Lock is the one-way node lock. The zero value is not usable; create it with New.
type Lock struct {
	markers []Marker

	mu     sync.Mutex
	locked bool
	owner  string
}

// New returns an unlocked Lock that records the transition with every marker, in order.
func New(markers ...Marker) *Lock {
	return &Lock{markers: markers}
}

// TryLockOnce takes the lock for owner (e.g. "init" or "join") and marks the node as belonging to
// clusterID. Exactly one call ever succeeds; every other returns ErrLocked. If marking fails, the lock
// stays taken (the node may be half-marked and must not be used for another cluster) and the error is
// returned to the winner.
func (l *Lock) TryLockOnce(ctx context.Context, owner string, clusterID []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.locked {
		return fmt.Errorf("%w by %s", ErrLocked, l.owner)
	}
	l.locked = true
	l.owner = owner
	for _, m := range l.markers {
		if err := m.MarkBootstrapped(ctx, clusterID); err != nil {
			return fmt.Errorf("marking node as bootstrapped: %w", err)
		}
	}
	return nil
}

// Locked reports whether the lock was taken, and by whom.
func (l *Lock) Locked() (bool, string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.locked, l.owner
}

// Bootstrapped reports whether any marker says the node was bootstrapped before (e.g. before a reboot).
func (l *Lock) Bootstrapped(ctx context.Context) (bool, error) {
	for _, m := range l.markers {
		ok, err := m.Bootstrapped(ctx)
		if err != nil {
			return false, fmt.Errorf("reading bootstrap marker: %w", err)
		}
		if ok {
			return true, nil
		}
	}
	return false, nil
}

// Marker records durably that the node was bootstrapped.
type Marker interface {
	// MarkBootstrapped records that the node belongs to the cluster clusterID. It MUST be durable
	// before it returns. It is called at most once per Lock.
	MarkBootstrapped(ctx context.Context, clusterID []byte) error
	// Bootstrapped reports whether the node was marked, by this process or an earlier one.
	Bootstrapped(ctx context.Context) (bool, error)
}
