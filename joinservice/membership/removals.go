package membership

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/joinservice/server"
)

// RemoveInterval is how often each replica looks for control-plane removals whose etcd member is
// still to be removed.
const RemoveInterval = time.Second

// Removals are the removed control planes whose etcd member is still to be removed, and where the
// outcome goes (registry.Registry).
type Removals interface {
	Removals() []machines.Machine
	SetEtcd(ctx context.Context, identity string, state machines.EtcdState, message string) error
}

// Addresses returns the addresses the platform gives node (metadata); none when it does not know it.
type Addresses func(ctx context.Context, node string) []string

// RunRemovals removes the etcd member of every pending control-plane removal and records the outcome,
// until ctx ends. Each removal takes the control-plane slot (lock), so it never overlaps a control
// plane's join or another removal, on any replica. Every replica runs it; the first to decide a
// removal records it, later ones change nothing. It returns nil when ctx ends.
func (e *Etcd) RunRemovals(ctx context.Context, rec Removals, lock server.ControlPlaneLock, addrs Addresses) error {
	t := time.NewTicker(RemoveInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		for _, m := range rec.Removals() {
			if ctx.Err() != nil {
				return nil
			}
			e.removeOne(ctx, rec, lock, addrs, m)
		}
	}
}

func (e *Etcd) removeOne(ctx context.Context, rec Removals, lock server.ControlPlaneLock, addrs Addresses, m machines.Machine) {
	log := e.log.With(zap.String("node", m.Node))
	slot, err := lock.Lock(ctx, "remove:"+m.Node)
	if errors.Is(err, server.ErrControlPlaneBusy) {
		log.Info("etcd member removal waits for the control-plane slot", zap.Error(err))
		return
	}
	if err != nil {
		log.Warn("taking the control-plane slot to remove an etcd member", zap.Error(err))
		return
	}
	defer slot.Release()
	state, msg, err := e.Remove(ctx, m.Node, addrs(ctx, m.Node), m.Removal.Force)
	if err != nil {
		log.Warn("removing the etcd member of a removed control plane", zap.Error(err))
		msg = err.Error()
	}
	if err := rec.SetEtcd(ctx, m.Identity, state, msg); err != nil {
		log.Warn("recording the etcd member removal", zap.Error(err))
	}
}
