package bootstrapper

import (
	"context"
	"errors"
	"math"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/bootstrapper/joinclient"
)

// CheckInFunc asks the cluster whether this joined node may run, in rounds separated by backoff's
// steps (joinclient.CheckIn): nil once admitted, an error wrapping joinclient.ErrRevoked when the
// machine was removed, any other error when no joinservice answered before backoff ran out.
type CheckInFunc func(ctx context.Context, backoff wait.Backoff) error

// Locker locks a node the cluster answered REVOKED (bootstage.Stage.Lock): its sealed disk key is
// destroyed, so no later boot opens the state disk without the cluster or the operator.
type Locker interface {
	Lock(ctx context.Context) error
}

// checkInTiming is how often a node checks in after its first round: beside a running kubelet, or
// while the machine is revoked.
type checkInTiming struct {
	// first is a worker's first check-in, before its kubelet starts (joinclient.CheckInBackoff).
	first wait.Backoff
	// background is beside a running kubelet: every half minute at most, for as long as the daemon runs.
	background wait.Backoff
	// revoked is the wait after a REVOKED answer before the next check-in.
	revoked time.Duration
}

var defaultCheckInTiming = checkInTiming{
	first:      joinclient.CheckInBackoff,
	background: wait.Backoff{Duration: time.Second, Factor: 2, Jitter: 0.2, Steps: math.MaxInt32, Cap: 30 * time.Second},
	revoked:    10 * time.Second,
}

// kubeletCtl is what the check-in does with the kubelet.
type kubeletCtl interface {
	Start(ctx context.Context) error
	Stop(ctx context.Context) error
}

// checkIn runs a node's check-ins until one admits it with its kubelet running, or ctx ends. A
// worker (blocking) checks in before its kubelet starts: for the first backoff's rounds, then, with
// no answer, it starts the kubelet and keeps asking beside it. A control plane starts its kubelet at
// once (its kubelet runs the joinservice it would ask: after a full power cut no control plane would
// ever start) and asks beside it. A REVOKED answer stops the kubelet, or keeps it from starting,
// locks the node (lock) and keeps asking: only a re-admission (berth node readmit) starts it again.
func checkIn(ctx context.Context, log *zap.Logger, check CheckInFunc, kube kubeletCtl, lock Locker, blocking bool, timing checkInTiming) {
	running, locked := false, false
	start := func() {
		if err := kube.Start(ctx); err != nil {
			log.Error("starting kubelet", zap.Error(err))
		}
		running = true
	}
	backoff := timing.first
	if !blocking {
		start()
		backoff = timing.background
	}
	for {
		err := check(ctx, backoff)
		switch {
		case err == nil:
			if locked {
				log.Info("the machine was re-admitted: starting the kubelet")
			}
			if !running {
				start()
			}
			return
		case ctx.Err() != nil:
			return
		case errors.Is(err, joinclient.ErrRevoked):
			if running {
				if err := kube.Stop(ctx); err != nil {
					log.Error("stopping the kubelet of a revoked machine", zap.Error(err))
				}
				running = false
			}
			if !locked {
				log.Error("this machine was removed from the cluster: its kubelet does not run until an operator re-admits it (berth node readmit)",
					zap.Error(err))
				if lock != nil {
					if err := lock.Lock(ctx); err != nil {
						log.Error("locking the revoked machine failed; its kubelet stays stopped", zap.Error(err))
					}
				}
				locked = true
			}
			t := time.NewTimer(timing.revoked)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			backoff = timing.background
		default:
			if !running {
				log.Warn("no joinservice answered the check-in: starting the kubelet, checking in again beside it", zap.Error(err))
				start()
			}
			backoff = timing.background
		}
	}
}
