// Package bootstrapper is the daemon every node runs. Run is the only place where its two actors
// meet: the InitServer (waits for `berth init`) and the JoinClient (waits for a join ticket) run in
// one errgroup under a shared context, behind the one-way node lock. Whichever takes the lock first
// wins; the other's context is cancelled, so its listener closes and its goroutines end.
//
// What Run does depends on the node's persisted state:
//
//	marker  state                  runs
//	no      none                   InitServer + JoinClient, racing for the lock
//	yes     init, not done         InitServer only (resumes the init with the same secrets)
//	yes     init, done             InitServer only (answers "already initialized"), kubelet, and
//	                               Reconcile: the cluster's components are checked again
//	yes     join, done             kubelet only
//	yes     join, not done         nothing: ErrIncompleteJoin (only without a state disk: the boot
//	                               stage wipes the state disk of such a node and it starts fresh)
//	yes     none                   nothing: ErrInconsistentState
//
// Before Run, the command runs the boot stage (package bootstage): the state above lives on the
// node's encrypted state disk, which is open, bound over the node's paths and has re-extended the
// lock register by the time Run reads it.
//
// The kubelet supervisor runs in the same group for the daemon's whole life, and so do the
// control-plane certificate renewer where the daemon is the node's supervisor (no systemd), and on
// a control plane the KMS plugin's supervisor and its key keeper (package kmskeeper). When the boot
// stage booted on the sealed key because no joinservice answered its check-in, the group also owns
// the later check-ins (Deps.CheckIn) until one answers.
package bootstrapper

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"

	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/bootstrapper/initserver"
	"github.com/berth-k8s/berth/internal/nodestate"
	"github.com/berth-k8s/berth/internal/sdnotify"
	"github.com/berth-k8s/berth/nodelock"
)

// Named reasons the daemon cannot run.
var (
	ErrIncompleteJoin    = errors.New("node took the lock to join but the join did not finish; reset the node (with a state disk this cannot happen: the next boot wipes it)")
	ErrInconsistentState = errors.New("node is marked bootstrapped but has no node state; reboot the node (the lock register resets, and with a state disk the node starts fresh) or reset it")
)

// Deps are the daemon's parts, built by the command from its configuration.
type Deps struct {
	Log *zap.Logger
	// Lock is the node lock shared by both actors.
	Lock *Race
	// State is the node's persisted state.
	State interface {
		Load() (*nodestate.State, error)
	}
	// InitListener is the InitServer's bound listener; Run closes it.
	InitListener net.Listener
	InitServer   interface {
		Serve(ctx context.Context, lis net.Listener) error
	}
	JoinClient interface {
		Run(ctx context.Context) error
	}
	Kubelet interface {
		Start(ctx context.Context) error
		Run(ctx context.Context) error
	}
	// KMS is the control plane's KMS key keeper (kmskeeper.Keeper) and KMSPlugin the plugin process
	// it drives (kmsplugin.Supervisor); both run for the daemon's whole life and do nothing on a node
	// without KMS keys (a worker). Restore loads the keys a control plane saved at init or join, so
	// its API server can decrypt again after a reboot. Nil leaves encryption at rest out.
	KMS interface {
		Restore() (bool, error)
		Run(ctx context.Context) error
	}
	KMSPlugin interface {
		Run(ctx context.Context) error
	}
	// Reconcile checks the cluster's components after a restart of a node that finished init: it
	// waits for them to come back and repairs only what differs (the command wires the image-policy
	// webhook's install.Reconcile). Its error is logged, never fatal: the daemon keeps serving. Nil
	// means no check.
	Reconcile func(ctx context.Context) error
	// CertRenewer renews this node's control-plane certificates before they expire, for the
	// daemon's whole life (bootstrapper/certrenew; a node that is not a control plane, or not yet,
	// only looks for one now and then). Nil leaves them to the OS image's timer.
	CertRenewer interface {
		Run(ctx context.Context) error
	}
	// CheckIn checks in with the cluster after a boot whose check-in no joinservice answered
	// (bootstage.Stage.KeepCheckingIn): it runs in the group, after the kubelet was started, until
	// one answers. A REVOKED answer locks the node (sealed key destroyed, kubelet stopped, state disk
	// closed) and CheckIn returns an error, which is logged and never ends the daemon: the daemon
	// keeps running without a kubelet, so that nothing in this boot starts the node again. Nil means
	// no later check-in.
	CheckIn func(ctx context.Context) error
	// Notify tells the service manager the daemon is ready; nil means sd_notify.
	Notify func() error
}

type mode int

const (
	modeFresh mode = iota
	modeInitialized
	modeJoined
)

// Run runs the daemon until ctx ends or, where nothing is left to do, until the work is done.
func Run(ctx context.Context, d Deps) error {
	log := d.Log
	m, st, err := decide(ctx, d)
	if err != nil {
		d.InitListener.Close()
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return d.Kubelet.Run(gctx) })
	if d.CertRenewer != nil {
		g.Go(func() error { return d.CertRenewer.Run(gctx) })
	}
	if d.KMS != nil {
		// Before the kubelet starts the API server: its plugin should be up when it asks.
		restored, err := d.KMS.Restore()
		if err != nil {
			log.Error("restoring the KMS keys: this control plane's API server cannot decrypt Secrets", zap.Error(err))
		} else if restored {
			log.Info("KMS keys restored from the state disk")
		}
		// A node that joined without keys is a worker: it never runs a plugin, and the daemon need
		// not stay for one. Any other node may still get keys (init, a control-plane join).
		if m != modeJoined || restored || err != nil {
			g.Go(func() error { return d.KMSPlugin.Run(gctx) })
			g.Go(func() error { return d.KMS.Run(gctx) })
		}
	}
	switch m {
	case modeFresh:
		log.Info("fresh node: waiting for init or a join ticket")
		initCtx, cancelInit := context.WithCancel(gctx)
		joinCtx, cancelJoin := context.WithCancel(gctx)
		d.Lock.onWin(func(owner string) {
			log.Info("node lock taken", zap.String("owner", owner))
			if owner == initserver.LockOwner {
				cancelJoin()
			} else {
				cancelInit()
			}
		})
		g.Go(func() error {
			defer cancelInit()
			return d.InitServer.Serve(initCtx, d.InitListener)
		})
		g.Go(func() error {
			defer cancelJoin()
			if err := d.JoinClient.Run(joinCtx); err != nil {
				return fmt.Errorf("joining: %w", err)
			}
			return nil
		})
	case modeInitialized:
		log.Info("node initialized a cluster before", zap.Bool("done", st.Done), zap.Strings("completedPhases", st.CompletedPhases))
		if st.Done || st.Completed(initcluster.PhaseKubeadmInit) {
			if err := d.Kubelet.Start(gctx); err != nil {
				log.Error("starting kubelet", zap.Error(err))
			}
		}
		g.Go(func() error { return d.InitServer.Serve(gctx, d.InitListener) })
		if st.Done && d.Reconcile != nil {
			g.Go(func() error {
				err := d.Reconcile(gctx)
				switch {
				case err == nil:
					log.Info("cluster components checked after the restart")
				case gctx.Err() == nil:
					log.Error("checking the cluster's components after the restart failed; nothing was disarmed", zap.Error(err))
				}
				return nil
			})
		}
	case modeJoined:
		log.Info("node joined a cluster before: starting kubelet", zap.String("nodeName", st.NodeName))
		d.InitListener.Close()
		if err := d.Kubelet.Start(gctx); err != nil {
			log.Error("starting kubelet", zap.Error(err))
		}
	}
	if d.CheckIn != nil {
		g.Go(func() error {
			if err := d.CheckIn(gctx); err != nil && gctx.Err() == nil {
				log.Error("the check-in after the boot locked the node", zap.Error(err))
			}
			return nil
		})
	}
	notify := d.Notify
	if notify == nil {
		notify = func() error { _, err := sdnotify.Ready(); return err }
	}
	if err := notify(); err != nil {
		log.Warn("notifying service manager", zap.Error(err))
	}
	return g.Wait()
}

func decide(ctx context.Context, d Deps) (mode, *nodestate.State, error) {
	bootstrapped, err := d.Lock.lock.Bootstrapped(ctx)
	if err != nil {
		return 0, nil, err
	}
	st, err := d.State.Load()
	if err != nil {
		return 0, nil, err
	}
	switch {
	case !bootstrapped && st == nil:
		return modeFresh, nil, nil
	case st != nil && st.Role == nodestate.RoleInit:
		return modeInitialized, st, nil
	case st != nil && st.Role == nodestate.RoleJoin && st.Done:
		return modeJoined, st, nil
	case st != nil && st.Role == nodestate.RoleJoin:
		return 0, nil, ErrIncompleteJoin
	default:
		return 0, nil, ErrInconsistentState
	}
}

// Race is the node lock as the two actors share it: the winner's TryLockOnce cancels the loser.
type Race struct {
	lock *nodelock.Lock

	mu      sync.Mutex
	handler func(owner string)
}

// NewRace wraps lock.
func NewRace(lock *nodelock.Lock) *Race { return &Race{lock: lock} }

func (r *Race) onWin(f func(owner string)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.handler = f
}

// TryLockOnce takes the node lock for owner and, on success, cancels the other actor.
func (r *Race) TryLockOnce(ctx context.Context, owner string, clusterID []byte) error {
	if err := r.lock.TryLockOnce(ctx, owner, clusterID); err != nil {
		return err
	}
	r.mu.Lock()
	h := r.handler
	r.mu.Unlock()
	if h != nil {
		h(owner)
	}
	return nil
}
