// Package cplease serializes the control planes' membership changes across joinservice replicas
// with a coordination.k8s.io Lease (berth-control-plane-join in the joinservice's namespace): etcd
// grows and shrinks one member at a time, and a control plane's join holds the slot from its ticket
// until it has really joined.
//
// The Lease is in one of three states:
//   - free: no holder;
//   - taken: a replica holds it while it makes a ticket or removes an etcd member. The holder identity
//     is replica/holder/random and it expires after TTL (default 30 s), so a replica that dies while
//     holding it blocks the next change for at most TTL;
//   - joining: a control plane got its ticket and is joining. The holder identity is join/NODE,
//     annotations name the node, its address and the replica that issued the ticket, and the state
//     lasts at most JoinTimeout (default 5 min): kubeadm join on the node adds its etcd member as a
//     learner, promotes it, and starts its API server.
//
// Every replica runs Watch. While the Lease is joining, each asks its Observer every ObserveInterval
// whether the join finished (the node's etcd member voting and healthy, its API server ready); the
// first that sees it finished frees the Lease and records a control-plane-join entry in the ledger.
// Once JoinTimeout passed, the first replica that sees it (a Watch or a Lock) frees it and records
// the entry rejected with reason CONTROL_PLANE_JOIN_TIMEOUT and what the last observation lacked.
// Freeing is an update with the read resourceVersion, so exactly one replica records each end.
// The node that holds a joining Lease may take it again at once (it asks for a new ticket because its
// join failed); anyone else waits. Because every replica watches, a join started through a replica
// that then dies still frees the slot when it finishes.
//
// A Lock that finds the Lease held polls every 100-200 ms for up to MaxWait (default 10 s), then gives
// up with server.ErrControlPlaneBusy naming the holder, and the node retries. Expiry is judged by the
// judging replica's clock against the Lease's renewTime, so control-plane clocks must agree to well
// within TTL.
package cplease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinservice/server"
)

// LeaseName is the Lease that serializes control-plane joins.
const LeaseName = joinconfig.ControlPlaneJoinLease

// Defaults.
const (
	DefaultTTL         = 30 * time.Second
	DefaultMaxWait     = 10 * time.Second
	DefaultJoinTimeout = 5 * time.Minute
	// ObserveInterval is how often each replica asks its Observer about a joining control plane.
	ObserveInterval = 2 * time.Second
	// observeTimeout bounds one observation.
	observeTimeout = 5 * time.Second
)

// pollInterval is the wait between attempts on a held Lease; each wait adds up to pollJitter of it.
const (
	pollInterval = 100 * time.Millisecond
	pollJitter   = 1.0
)

// Annotations of a joining Lease.
const (
	annotationNode    = "berth.dev/joining-node"
	annotationAddress = "berth.dev/joining-address"
	annotationReplica = "berth.dev/ticket-replica"
	// joinPrefix starts the holder identity of a joining Lease.
	joinPrefix = "join/"
)

// Journal records the ends of joining slots (ledger.Writer). Record must return at once.
type Journal interface {
	Record(joinledger.Entry)
}

// Observer judges whether a control plane's join finished.
type Observer interface {
	// JoinDone reports whether the control plane node at address has joined, and what it saw.
	JoinDone(ctx context.Context, node, address string) (done bool, detail string)
}

// Lock implements server.ControlPlaneLock with a Lease.
type Lock struct {
	client    kubernetes.Interface
	namespace string
	replica   string
	journal   Journal
	log       *zap.Logger
	// TTL is how long a taken Lease counts as held without being released.
	TTL time.Duration
	// MaxWait bounds how long Lock waits for another holder.
	MaxWait time.Duration
	// JoinTimeout bounds how long a joining control plane holds the Lease.
	JoinTimeout time.Duration
}

var _ server.ControlPlaneLock = (*Lock)(nil)

// New returns a Lock on the Lease in namespace for replica, recording the ends of joins in journal
// (nil: nowhere).
func New(client kubernetes.Interface, namespace, replica string, journal Journal, log *zap.Logger) *Lock {
	if log == nil {
		log = zap.NewNop()
	}
	if journal == nil {
		journal = nopJournal{}
	}
	return &Lock{client: client, namespace: namespace, replica: replica, journal: journal, log: log,
		TTL: DefaultTTL, MaxWait: DefaultMaxWait, JoinTimeout: DefaultJoinTimeout}
}

type nopJournal struct{}

func (nopJournal) Record(joinledger.Entry) {}

// Lock takes the Lease for holder (the joining node's name, or what a removal names) or returns
// server.ErrControlPlaneBusy, naming who holds it, when it stays held for MaxWait or ctx ends; other
// API errors are returned as they are.
func (l *Lock) Lock(ctx context.Context, holder string) (server.ControlPlaneSlot, error) {
	suffix := make([]byte, 4)
	if _, err := rand.Read(suffix); err != nil {
		return nil, fmt.Errorf("generating lease holder identity: %w", err)
	}
	id := l.replica + "/" + holder + "/" + hex.EncodeToString(suffix)
	wctx, cancel := context.WithTimeout(ctx, l.MaxWait)
	defer cancel()
	busy, first := "", ""
	poll := wait.Backoff{Duration: pollInterval, Jitter: pollJitter, Steps: math.MaxInt32}
	err := wait.ExponentialBackoffWithContext(wctx, poll, func(ctx context.Context) (bool, error) {
		ok, by, err := l.tryAcquire(ctx, id, holder)
		busy = by
		if first == "" {
			first = by
		}
		return ok, err
	})
	if err != nil {
		if wctx.Err() != nil {
			if busy == "" {
				return nil, server.ErrControlPlaneBusy
			}
			return nil, fmt.Errorf("%w: %s", server.ErrControlPlaneBusy, busy)
		}
		return nil, err
	}
	return &slot{l: l, id: id, waitedFor: first}, nil
}

// tryAcquire makes one attempt: true when id now holds the Lease, else who holds it.
func (l *Lock) tryAcquire(ctx context.Context, id, holder string) (bool, string, error) {
	leases := l.client.CoordinationV1().Leases(l.namespace)
	now := metav1.NewMicroTime(time.Now())
	secs := int32(l.TTL / time.Second)
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		zero := int32(0)
		_, err := leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: LeaseName, Namespace: l.namespace},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity: &id, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now, LeaseTransitions: &zero,
			},
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return false, "", nil
		}
		if err != nil {
			return false, "", fmt.Errorf("creating lease: %w", err)
		}
		return true, "", nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading lease: %w", err)
	}
	if node, ok := joiningNode(lease); ok {
		switch {
		case node == holder:
			// The joining node asks again: its join failed and it starts over.
		case expired(lease):
			l.timeout(ctx, lease, "")
			return false, describe(lease), nil
		default:
			return false, describe(lease), nil
		}
	} else if held(lease) {
		return false, describe(lease), nil
	}
	transitions := int32(1)
	if lease.Spec.LeaseTransitions != nil {
		transitions = *lease.Spec.LeaseTransitions + 1
	}
	lease.Spec = coordinationv1.LeaseSpec{
		HolderIdentity: &id, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now, LeaseTransitions: &transitions,
	}
	clearJoining(lease)
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		return false, "", nil
	}
	if err != nil {
		return false, "", fmt.Errorf("taking lease: %w", err)
	}
	return true, "", nil
}

// joiningNode returns the node a joining Lease holds the slot for.
func joiningNode(lease *coordinationv1.Lease) (string, bool) {
	h := lease.Spec.HolderIdentity
	if h == nil || !strings.HasPrefix(*h, joinPrefix) {
		return "", false
	}
	return strings.TrimPrefix(*h, joinPrefix), true
}

// held reports whether someone holds lease and it has not expired.
func held(lease *coordinationv1.Lease) bool {
	if h := lease.Spec.HolderIdentity; h == nil || *h == "" {
		return false
	}
	return !expired(lease)
}

// expired reports whether lease's holder let it run out.
func expired(lease *coordinationv1.Lease) bool {
	s := lease.Spec
	if s.RenewTime == nil || s.LeaseDurationSeconds == nil {
		return true
	}
	return !time.Now().Before(s.RenewTime.Add(time.Duration(*s.LeaseDurationSeconds) * time.Second))
}

// describe says who holds lease, for the busy error the joining node sees.
func describe(lease *coordinationv1.Lease) string {
	since := ""
	if lease.Spec.AcquireTime != nil {
		since = fmt.Sprintf(" since %s (%s)", lease.Spec.AcquireTime.UTC().Format(time.RFC3339), time.Since(lease.Spec.AcquireTime.Time).Round(time.Second))
	}
	if node, ok := joiningNode(lease); ok {
		return fmt.Sprintf("control plane %s is joining%s", node, since)
	}
	if h := lease.Spec.HolderIdentity; h != nil {
		parts := strings.SplitN(*h, "/", 3)
		if len(parts) == 3 {
			return fmt.Sprintf("replica %s holds the control-plane slot for %s%s", parts[0], parts[1], since)
		}
	}
	return "the control-plane slot is held" + since
}

// clearJoining removes the joining annotations.
func clearJoining(lease *coordinationv1.Lease) {
	for _, k := range []string{annotationNode, annotationAddress, annotationReplica} {
		delete(lease.Annotations, k)
	}
}

// slot is a Lease this replica took.
type slot struct {
	l  *Lock
	id string
	// waitedFor is who held the Lease when Lock first found it taken.
	waitedFor string
	once      sync.Once
}

// WaitedFor says who held the Lease while Lock waited; empty when it was free.
func (s *slot) WaitedFor() string { return s.waitedFor }

// Release clears the holder if it is still this slot's. Failures only delay the next change until
// the TTL.
func (s *slot) Release() { s.once.Do(func() { s.l.release(s.id) }) }

// Joining turns the taken Lease into a joining one for node at address.
func (s *slot) Joining(ctx context.Context, node, address string) error {
	leases := s.l.client.CoordinationV1().Leases(s.l.namespace)
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading lease: %w", err)
	}
	if h := lease.Spec.HolderIdentity; h == nil || *h != s.id {
		return errors.New("the control-plane slot expired and was taken over while the ticket was made")
	}
	holder := joinPrefix + node
	now := metav1.NewMicroTime(time.Now())
	secs := int32(s.l.JoinTimeout / time.Second)
	lease.Spec.HolderIdentity = &holder
	lease.Spec.LeaseDurationSeconds = &secs
	lease.Spec.AcquireTime, lease.Spec.RenewTime = &now, &now
	if lease.Annotations == nil {
		lease.Annotations = map[string]string{}
	}
	lease.Annotations[annotationNode] = node
	lease.Annotations[annotationAddress] = address
	lease.Annotations[annotationReplica] = s.l.replica
	if _, err := leases.Update(ctx, lease, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("handing the lease to %s's join: %w", node, err)
	}
	s.once.Do(func() {}) // the join holds it now; Release must not clear it
	s.l.log.Info("control-plane slot held for the join", zap.String("node", node), zap.String("address", address), zap.Duration("timeout", s.l.JoinTimeout))
	return nil
}

// release clears the holder if it is still id.
func (l *Lock) release(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	leases := l.client.CoordinationV1().Leases(l.namespace)
	for range 5 {
		lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
		if err != nil {
			l.log.Warn("releasing control-plane join lease", zap.Error(err))
			return
		}
		if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity != id {
			return // expired and taken over
		}
		free(lease)
		_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
		if err == nil {
			return
		}
		if !apierrors.IsConflict(err) {
			l.log.Warn("releasing control-plane join lease", zap.Error(err))
			return
		}
	}
}

// free clears lease's holder.
func free(lease *coordinationv1.Lease) {
	lease.Spec.HolderIdentity = nil
	lease.Spec.RenewTime = nil
	lease.Spec.AcquireTime = nil
	clearJoining(lease)
}

// endJoin frees the joining lease as it was read (its resourceVersion) and records the end in the
// ledger; false when another replica changed the Lease first.
func (l *Lock) endJoin(ctx context.Context, lease *coordinationv1.Lease, e joinledger.Entry) bool {
	node, _ := joiningNode(lease)
	e.Time = time.Now().UTC()
	e.Node, e.Peer, e.Role, e.RPC = node, lease.Annotations[annotationAddress], "control-plane", joinledger.RPCControlPlaneJoin
	e.Replica = l.replica
	if lease.Spec.AcquireTime != nil {
		e.TicketIssued = lease.Spec.AcquireTime.UTC()
	}
	cp := lease.DeepCopy()
	free(cp)
	if _, err := l.client.CoordinationV1().Leases(l.namespace).Update(ctx, cp, metav1.UpdateOptions{}); err != nil {
		if !apierrors.IsConflict(err) {
			l.log.Warn("freeing the control-plane slot", zap.String("node", node), zap.Error(err))
		}
		return false
	}
	l.journal.Record(e)
	return true
}

// heldFor says how long lease has been joining and which replica issued its ticket.
func heldFor(lease *coordinationv1.Lease) string {
	d := ""
	if lease.Spec.AcquireTime != nil {
		d = time.Since(lease.Spec.AcquireTime.Time).Round(100 * time.Millisecond).String()
	}
	return fmt.Sprintf("%s after the ticket (issued by %s)", d, lease.Annotations[annotationReplica])
}

// timeout frees a joining lease whose JoinTimeout passed; lastSeen is what the last observation
// lacked, if any.
func (l *Lock) timeout(ctx context.Context, lease *coordinationv1.Lease, lastSeen string) {
	msg := "the slot was freed " + heldFor(lease) + ": the join did not finish in time"
	if lastSeen != "" {
		msg += "; last seen: " + lastSeen
	}
	if l.endJoin(ctx, lease, joinledger.Entry{Outcome: joinledger.OutcomeRejected, Reason: joinledger.ReasonControlPlaneJoinTimeout, Message: msg}) {
		node, _ := joiningNode(lease)
		l.log.Warn("control-plane join timed out: slot freed", zap.String("node", node), zap.String("lastSeen", lastSeen))
	}
}

// Watch frees the Lease when the control plane that holds it has joined (obs says so) or its join
// timed out, until ctx ends. Every replica runs it. It returns nil when ctx ends.
func (l *Lock) Watch(ctx context.Context, obs Observer) error {
	factory := informers.NewSharedInformerFactoryWithOptions(l.client, 0, informers.WithNamespace(l.namespace),
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
		watched      string // the joining lease's node/acquire time the observations are about
	)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		lease, err := leases.Lister().Leases(l.namespace).Get(LeaseName)
		if err != nil {
			continue
		}
		node, joining := joiningNode(lease)
		if !joining {
			watched, lastSeen = "", ""
			continue
		}
		if key := node + "@" + lease.ResourceVersion; key != watched {
			watched, lastSeen, lastObserved = key, "", time.Time{}
		}
		if expired(lease) {
			l.timeout(ctx, lease, lastSeen)
			continue
		}
		if time.Since(lastObserved) < ObserveInterval {
			continue
		}
		lastObserved = time.Now()
		octx, cancel := context.WithTimeout(ctx, observeTimeout)
		done, detail := obs.JoinDone(octx, node, lease.Annotations[annotationAddress])
		cancel()
		lastSeen = detail
		if !done {
			continue
		}
		if l.endJoin(ctx, lease, joinledger.Entry{Outcome: joinledger.OutcomeAccepted, Message: "joined " + heldFor(lease) + ": " + detail}) {
			l.log.Info("control plane joined: slot freed", zap.String("node", node), zap.String("detail", detail))
		}
	}
}
