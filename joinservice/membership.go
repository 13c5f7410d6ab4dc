package joinservice

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/cpslot"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/webhookconfig"
	"github.com/berth-k8s/berth/joinservice/health"
	"github.com/berth-k8s/berth/joinservice/ledger"
	"github.com/berth-k8s/berth/joinservice/membership"
	"github.com/berth-k8s/berth/joinservice/registry"
	"github.com/berth-k8s/berth/joinservice/server"
	"github.com/berth-k8s/berth/joinservice/spread"
)

// condMachines is the readiness condition of the machine record: read at least once, so removed
// machines are refused.
const condMachines = "machine-record"

// membershipParts are the parts that keep the control planes' membership: the machine record, the
// control-plane slot, etcd, and the webhook replicas' spread over the nodes.
type membershipParts struct {
	record *registry.Registry
	lock   *cpslot.Slot
	etcd   *membership.Etcd
	spread *spread.Keeper
}

// newMembership builds the membership parts of d.
func newMembership(d Deps, journal *ledger.Writer) membershipParts {
	log := d.Log
	lock := cpslot.New(d.Client, d.Namespace, d.Replica, journal, log.Named("slot"))
	if d.ControlPlaneJoinTimeout > 0 {
		lock.JoinTimeout = d.ControlPlaneJoinTimeout
	}
	return membershipParts{
		record: registry.New(d.Client, d.Namespace, log.Named("machines")),
		lock:   lock,
		etcd:   membership.New(d.PKIDir, log.Named("etcd")),
		spread: spread.New(d.Client, d.Namespace, webhookconfig.Name, log.Named("webhook-spread")),
	}
}

// run runs the membership loops on g: the machine record's watch, the watch that frees the
// control-plane slot when a join finished, the keeper of the webhook replicas' spread, and the
// removal of removed control planes' etcd members.
func (p membershipParts) run(ctx context.Context, g *errgroup.Group, d Deps, probes *health.Probes) {
	recordEnded := probes.Started("machine-record")
	g.Go(func() error {
		err := p.record.Run(ctx)
		recordEnded(err)
		return err
	})
	probes.Set(condMachines, errors.New("the machine record has not been read yet"))
	watchEnded := probes.Started("control-plane-slot")
	g.Go(func() error {
		err := p.lock.Watch(ctx, p.etcd)
		watchEnded(err)
		return err
	})
	spreadEnded := probes.Started("webhook-spread")
	g.Go(func() error {
		err := p.spread.Run(ctx)
		spreadEnded(err)
		return err
	})
	removalsEnded := probes.Started("etcd-removals")
	g.Go(func() error {
		err := p.etcd.RunRemovals(ctx, p.record, server.SlotLock{Slot: p.lock}, func(ctx context.Context, node string) []string {
			return addressesOf(ctx, d, node)
		})
		removalsEnded(err)
		return err
	})
}

// waitRead waits until the machine record was read, then marks it ready and records this node in
// it; false when ctx ended first.
func (p membershipParts) waitRead(ctx context.Context, d Deps, probes *health.Probes) bool {
	_ = wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(context.Context) (bool, error) {
		return p.record.Synced(), nil
	}) // ends with ctx or once read
	if !p.record.Synced() {
		return false
	}
	probes.Set(condMachines, nil)
	p.record.Admit(selfMachine(ctx, d, d.Log))
	return true
}

// selfMachine is this control plane as the machine record knows it: its attested identity when it
// has one (the init node never joined through a joinservice, so this is how it gets into the record),
// else its instance name.
func selfMachine(ctx context.Context, d Deps, log *zap.Logger) machines.Machine {
	var id []byte
	if d.Identity != nil {
		var err error
		if id, err = d.Identity(ctx); err != nil {
			log.Warn("reading this node's machine identity: recording it by instance name", zap.Error(err))
			id = nil
		}
	}
	return machines.Machine{Identity: machines.Identity(id, d.Replica), Node: d.Replica, Role: machines.RoleControlPlane,
		Admitted: time.Now().UTC().Truncate(time.Second)}
}

// addressesOf returns node's addresses from metadata.
func addressesOf(ctx context.Context, d Deps, node string) []string {
	peers, err := d.Metadata.Peers(ctx)
	if err != nil {
		return nil
	}
	for _, p := range peers {
		if p.Name == node {
			return p.IPs
		}
	}
	return nil
}

// rotationLockWait bounds a webhook pass's wait for the control-plane slot before its CA rotation;
// the rotation then waits for a later pass, and the rest of the pass goes on.
const rotationLockWait = 30 * time.Second

// rotationLock is the control-plane slot as the certificate keeper's lock for the steps of the
// webhook's CA rotation, so that no control plane restarts (a renewal) or joins meanwhile.
func rotationLock(d Deps, log *zap.Logger) cpslot.Locker {
	slot := cpslot.New(d.Client, d.Namespace, d.Replica+"/cert-keeper", nil, log.Named("slot"))
	slot.MaxWait, slot.Poll = rotationLockWait, 2*time.Second
	return cpslot.Locker{Slot: slot, Operation: cpslot.WebhookCARotation, Node: webhookconfig.Name}
}
