package cpslot

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/joinledger"
)

// endJoin frees the joining lease as it was read (its resourceVersion) and records the end in the
// journal; false when another process changed the Lease first.
func (s *Slot) endJoin(ctx context.Context, lease *coordinationv1.Lease, e joinledger.Entry) bool {
	h, _ := holderOf(lease)
	e.Time = time.Now().UTC()
	e.Node, e.Peer, e.Role, e.RPC = h.Node, h.Address, "control-plane", joinledger.RPCControlPlaneJoin
	e.Replica = s.process
	e.TicketIssued = h.Since.UTC()
	cp := lease.DeepCopy()
	free(cp)
	if _, err := s.leases().Update(ctx, cp, metav1.UpdateOptions{}); err != nil {
		if !apierrors.IsConflict(err) {
			s.log.Warn("freeing the control-plane slot", zap.String("node", h.Node), zap.Error(err))
		}
		return false
	}
	s.journal.Record(e)
	return true
}

// heldFor says how long h has been joining and which replica issued its ticket.
func heldFor(h Holder) string {
	return fmt.Sprintf("%s after the ticket (issued by %s)", time.Since(h.Since).Round(100*time.Millisecond), h.Process)
}

// timeout frees a joining lease whose JoinTimeout passed; lastSeen is what the last observation
// lacked, if any.
func (s *Slot) timeout(ctx context.Context, lease *coordinationv1.Lease, lastSeen string) {
	h, _ := holderOf(lease)
	msg := "the slot was freed " + heldFor(h) + ": the join did not finish in time"
	if lastSeen != "" {
		msg += "; last seen: " + lastSeen
	}
	if s.endJoin(ctx, lease, joinledger.Entry{Outcome: joinledger.OutcomeRejected, Reason: joinledger.ReasonControlPlaneJoinTimeout, Message: msg}) {
		s.log.Warn("control-plane join timed out: slot freed", zap.String("node", h.Node), zap.String("lastSeen", lastSeen))
	}
}

// Watch frees the slot when the control plane whose join holds it has joined (obs says so) or its
// join timed out, recording each end in the Slot's journal, until ctx ends. Every joinservice
// replica runs it; the Slot needs a Journal. It returns nil when ctx ends.
func (s *Slot) Watch(ctx context.Context, obs Observer) error {
	if s.journal == nil {
		return errors.New("watching the control-plane slot: no journal to record the ends of joins")
	}
	factory := informers.NewSharedInformerFactoryWithOptions(s.client, 0, informers.WithNamespace(s.namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", LeaseName).String()
		}))
	leases := factory.Coordination().V1().Leases()
	inf := leases.Informer()
	// Every return below comes after ctx ended, which stops the informer Shutdown waits for.
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil
	}
	var (
		lastObserved time.Time
		lastSeen     string
		watched      string // the joining lease's node and version the observations are about
	)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		lease, err := leases.Lister().Leases(s.namespace).Get(LeaseName)
		if err != nil {
			continue
		}
		h, held := holderOf(lease)
		if !held || h.State != Joining {
			watched, lastSeen = "", ""
			continue
		}
		if key := h.Node + "@" + lease.ResourceVersion; key != watched {
			watched, lastSeen, lastObserved = key, "", time.Time{}
		}
		if expired(lease) {
			s.timeout(ctx, lease, lastSeen)
			continue
		}
		if time.Since(lastObserved) < ObserveInterval {
			continue
		}
		lastObserved = time.Now()
		octx, cancel := context.WithTimeout(ctx, observeTimeout)
		done, detail := obs.JoinDone(octx, h.Node, h.Address)
		cancel()
		lastSeen = detail
		if !done {
			continue
		}
		if s.endJoin(ctx, lease, joinledger.Entry{Outcome: joinledger.OutcomeAccepted, Message: "joined " + heldFor(h) + ": " + detail}) {
			s.log.Info("control plane joined: slot freed", zap.String("node", h.Node), zap.String("detail", detail))
		}
	}
}
