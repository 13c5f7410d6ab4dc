package command

import (
	"context"
	"errors"
	"math"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// A supervised child is started again 1 s after it exits, then after 2, 4, 8 and at most 10 s while
// it keeps exiting; a child that ran for longer than a minute starts the sequence over.
const (
	restartInitial    = time.Second
	restartCap        = 10 * time.Second
	restartResetAfter = time.Minute
)

func restartBackoff() wait.Backoff {
	return wait.Backoff{Duration: restartInitial, Factor: 2, Steps: math.MaxInt32, Cap: restartCap}
}

// Supervised is a child process as Supervise keeps it running.
type Supervised struct {
	// Ready, if set, is called before every start and returns once the child can start (the kubelet
	// waits there for kubeadm's files). Its time does not count as the child's run. An error from it
	// ends Supervise: with nil when ctx ended, else with that error.
	Ready func(ctx context.Context) error
	// Run runs the child once, until it exits or ctx ends. Whatever it returns, Supervise starts it
	// again after the restart wait, unless ctx ended or the error is Permanent.
	Run func(ctx context.Context) error
	// Restarting, if set, is told why the child exited and how long Supervise waits before it starts
	// it again (the caller logs it).
	Restarting func(err error, wait time.Duration)
}

// Supervise runs child until ctx ends, starting it again whenever it exits: 1 s after, then after 2,
// 4, 8 and at most 10 s while it keeps exiting; a run that lasted longer than a minute starts the
// sequence over. It returns nil when ctx ends (also while Run or Ready returns an error for it), the
// error a Permanent wrapped when Run returns one, and Ready's error. Supervise starts no goroutine of
// its own: it returns once Run and Ready have returned.
func Supervise(ctx context.Context, child Supervised) error {
	backoff := restartBackoff()
	for {
		if child.Ready != nil {
			if err := child.Ready(ctx); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
		}
		started := time.Now()
		err := child.Run(ctx)
		if ctx.Err() != nil {
			return nil
		}
		var perm *PermanentError
		if errors.As(err, &perm) {
			return perm.Err
		}
		if time.Since(started) > restartResetAfter {
			backoff = restartBackoff()
		}
		delay := backoff.Step()
		if child.Restarting != nil {
			child.Restarting(err, delay)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(delay): // a timer nobody reads is collected (Go 1.23)
		}
	}
}

// PermanentError is an exit Supervise does not restart after (Permanent).
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return e.Err.Error() }

func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent marks err, returned by a Supervised's Run, as final: Supervise returns err instead of
// starting the child again. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}
