// Package cpslot is the control-plane slot: the one Lease every operation that disrupts a control
// plane takes, so that at most one such operation runs in the cluster at a time and etcd quorum and
// the API servers' availability never depend on two of them at once. Both daemons take it: the
// joinservice for a control plane's join, for removing an etcd member and for the steps of the
// webhook's CA rotation that change what the API servers trust, the bootstrapper for a certificate
// renewal, which restarts the control plane's static pods (and, next, an upgrade).
//
// The slot is Lease berth-control-plane-slot in berth-system (joinconfig.ControlPlaneSlotLease),
// created unheld with the joinservice (internal/berthsystem) and by the first Acquire that finds
// none. The joinservice reaches it with its ServiceAccount's Role, the bootstrapper on a control
// plane as the cluster's admin (admin.conf). Its holder record is the Lease's spec and annotations:
//
//	record      Lease field                                  meaning
//	holder      spec.holderIdentity                          PROCESS/TOKEN while taken, join/NODE while joining
//	operation   annotation berth.dev/slot-operation          control-plane-join, etcd-member-removal, cert-renewal,
//	                                                         webhook-ca-rotation
//	node        annotation berth.dev/slot-node               the node the operation is about
//	process     annotation berth.dev/slot-process            the joinservice replica or the bootstrapper process
//	state       annotation berth.dev/slot-state              taken or joining
//	address     annotation berth.dev/slot-address            the joining node's address (joining only)
//	since       spec.acquireTime                             when the state was entered
//	until       spec.renewTime + spec.leaseDurationSeconds   when a holder that stopped renewing loses it
//
// States and transitions:
//
//	from     to       who                                   when
//	free     taken    Acquire (any process)                 at once
//	taken    taken    the holder's renewal loop             every Duration/10 while held: until moves on
//	taken    free     Held.Release                          the operation ended
//	taken    taken    Acquire of another process            until passed (the holder died or was cut off)
//	taken    joining  Held.Joining (joinservice)            the control plane's ticket is issued
//	joining  free     Watch of any joinservice replica      the Observer says the join finished: ledger entry accepted
//	joining  free     Watch or Acquire of a replica         JoinTimeout after the ticket: ledger entry rejected
//	                                                        (CONTROL_PLANE_JOIN_TIMEOUT, with what was last seen)
//	joining  taken    Acquire for the joining node itself   its join failed and it asks for a new ticket
//
// Timeouts: a taken slot lasts Duration (default 30 s) past its holder's last renewal; a joining slot
// lasts JoinTimeout (default 5 min) from its ticket, renewed by nobody. Expiry is judged by the
// judging process's clock against renewTime, so control-plane clocks must agree to well within
// Duration.
//
// Acquire polls a held slot every Poll to twice Poll (default 100 ms; the bootstrapper's 2 s) for up
// to MaxWait (default 10 s), then fails with
// ErrBusy naming the holder. Every change is an update with the resourceVersion read, so exactly one
// process wins each transition, and exactly one replica records each join's end. A join ends only
// through a Slot with a Journal (a joinservice replica): a Slot without one (the bootstrapper) waits
// for a replica to free an expired joining slot, so the join ledger misses no end.
//
// A holder renews the slot in a goroutine of its Held until Release, Joining, or the end of the
// context Acquire was given; a holder whose context ends without Release (or whose process dies)
// stops renewing, and the slot is free to the next Acquire once until passed. An operation that
// makes its own API server unreachable (a renewal restarting kube-apiserver on a single control
// plane) cannot renew meanwhile; its slot may then run out, which only matters where another API
// server serves the other processes.
package cpslot

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
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"

	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
)

// The slot's Lease.
const (
	LeaseName = joinconfig.ControlPlaneSlotLease
	Namespace = joinconfig.Namespace
)

// Operation is what a holder does with the slot.
type Operation string

// Operations that take the slot.
const (
	// ControlPlaneJoin: a joinservice replica makes a control plane's ticket, then hands the slot to
	// the join (Held.Joining).
	ControlPlaneJoin Operation = "control-plane-join"
	// EtcdMemberRemoval: a joinservice replica removes a removed control plane's etcd member.
	EtcdMemberRemoval Operation = "etcd-member-removal"
	// CertRenewal: a control plane's bootstrapper renews its certificates and restarts its static pods.
	CertRenewal Operation = "cert-renewal"
	// WebhookCARotation: the certificate keeper (in a joinservice replica) changes which CA the API
	// servers must trust for the image-policy webhook; an API server that restarted or joined in the
	// middle was seen refusing the webhook's certificate afterwards.
	WebhookCARotation Operation = "webhook-ca-rotation"
)

// State of a held slot.
type State string

// States of a held slot (a free slot has no holder).
const (
	Taken   State = "taken"
	Joining State = "joining"
)

// Defaults.
const (
	DefaultDuration    = 30 * time.Second
	DefaultMaxWait     = 10 * time.Second
	DefaultJoinTimeout = 5 * time.Minute
	DefaultPoll        = 100 * time.Millisecond
	// ObserveInterval is how often each replica asks its Observer about a joining control plane.
	ObserveInterval = 2 * time.Second
	// observeTimeout bounds one observation.
	observeTimeout = 5 * time.Second
	// renewFraction: a holder renews every Duration/renewFraction.
	renewFraction = 10
)

// pollJitter is the fraction of Poll added at random to each wait.
const pollJitter = 1.0

// Annotations of the holder record.
const (
	annotationOperation = "berth.dev/slot-operation"
	annotationNode      = "berth.dev/slot-node"
	annotationProcess   = "berth.dev/slot-process"
	annotationState     = "berth.dev/slot-state"
	annotationAddress   = "berth.dev/slot-address"
	// joinPrefix starts the holder identity of a joining slot.
	joinPrefix = "join/"
)

// ErrBusy is returned by Acquire when the slot stayed held for MaxWait or its context ended; its
// wrapping error names the holder.
var ErrBusy = errors.New("the control-plane slot is taken")

// Journal records the ends of joining slots (the joinservice's ledger writer). Record must return at
// once.
type Journal interface {
	Record(joinledger.Entry)
}

// Observer judges whether a control plane's join finished.
type Observer interface {
	// JoinDone reports whether the control plane node at address has joined, and what it saw.
	JoinDone(ctx context.Context, node, address string) (done bool, detail string)
}

// Holder is the holder record of a held slot.
type Holder struct {
	Operation Operation
	State     State
	// Node is the node the operation is about.
	Node string
	// Process is the joinservice replica or bootstrapper process that took the slot (for a joining
	// slot: the replica that issued the ticket).
	Process string
	// Address is the joining node's address.
	Address string
	// Since is when the state was entered; Until is when a holder that stopped renewing loses it.
	Since, Until time.Time
}

// String says who holds the slot, for errors and logs.
func (h Holder) String() string {
	since := ""
	if !h.Since.IsZero() {
		since = fmt.Sprintf(" since %s (%s)", h.Since.UTC().Format(time.RFC3339), time.Since(h.Since).Round(time.Second))
	}
	if h.State == Joining {
		return fmt.Sprintf("control plane %s is joining%s", h.Node, since)
	}
	if h.Operation == "" {
		return "the control-plane slot is held" + since
	}
	return fmt.Sprintf("%s holds the control-plane slot for the %s of %s%s", h.Process, h.Operation, h.Node, since)
}

// Slot takes the control-plane slot for one process.
type Slot struct {
	client    kubernetes.Interface
	namespace string
	process   string
	journal   Journal
	log       *zap.Logger
	// Duration is how long a taken slot counts as held past its holder's last renewal.
	Duration time.Duration
	// MaxWait bounds how long Acquire waits for another holder.
	MaxWait time.Duration
	// JoinTimeout bounds how long a joining control plane holds the slot.
	JoinTimeout time.Duration
	// Poll is the wait between Acquire's looks at a held slot; each wait adds up to as much again
	// at random.
	Poll time.Duration
}

// New returns a Slot on the Lease in namespace (Namespace, except in tests) for process, which
// names it in the holder record. journal records the ends of joins; nil for a process that does not
// end joins (see the package documentation).
func New(client kubernetes.Interface, namespace, process string, journal Journal, log *zap.Logger) *Slot {
	if log == nil {
		log = zap.NewNop()
	}
	return &Slot{client: client, namespace: namespace, process: process, journal: journal, log: log,
		Duration: DefaultDuration, MaxWait: DefaultMaxWait, JoinTimeout: DefaultJoinTimeout, Poll: DefaultPoll}
}

// Current returns the slot's holder record; false when the slot is free (or has no Lease yet).
func (s *Slot) Current(ctx context.Context) (Holder, bool, error) {
	lease, err := s.leases().Get(ctx, LeaseName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return Holder{}, false, nil
	}
	if err != nil {
		return Holder{}, false, fmt.Errorf("reading the control-plane slot: %w", err)
	}
	h, ok := holderOf(lease)
	return h, ok, nil
}

func (s *Slot) leases() coordinationv1client.LeaseInterface {
	return s.client.CoordinationV1().Leases(s.namespace)
}

// Acquire takes the slot for op about node, or returns ErrBusy, naming who holds it, when it stays
// held for MaxWait or ctx ends; other API errors are returned as they are. The Held renews the slot
// until Release, Joining or the end of ctx.
func (s *Slot) Acquire(ctx context.Context, op Operation, node string) (*Held, error) {
	suffix := make([]byte, 4)
	if _, err := rand.Read(suffix); err != nil {
		return nil, fmt.Errorf("generating the slot's holder identity: %w", err)
	}
	id := s.process + "/" + hex.EncodeToString(suffix)
	wctx, cancel := context.WithTimeout(ctx, s.MaxWait)
	defer cancel()
	busy, first := "", ""
	poll := wait.Backoff{Duration: s.Poll, Jitter: pollJitter, Steps: math.MaxInt32}
	err := wait.ExponentialBackoffWithContext(wctx, poll, func(ctx context.Context) (bool, error) {
		ok, by, err := s.tryAcquire(ctx, id, op, node)
		busy = by
		if first == "" {
			first = by
		}
		return ok, err
	})
	if err != nil {
		if wctx.Err() != nil {
			if busy == "" {
				return nil, ErrBusy
			}
			return nil, fmt.Errorf("%w: %s", ErrBusy, busy)
		}
		return nil, err
	}
	h := &Held{s: s, id: id, op: op, node: node, waitedFor: first}
	rctx, stop := context.WithCancel(ctx)
	h.stop, h.renewed = stop, make(chan struct{})
	go h.renewLoop(rctx)
	return h, nil
}

// take writes into lease the holder record of id taking it for op about node.
func (s *Slot) take(lease *coordinationv1.Lease, id string, op Operation, node string, now metav1.MicroTime) {
	secs := int32(s.Duration / time.Second)
	transitions := int32(0)
	if lease.Spec.LeaseTransitions != nil {
		transitions = *lease.Spec.LeaseTransitions + 1
	}
	lease.Spec = coordinationv1.LeaseSpec{
		HolderIdentity: &id, LeaseDurationSeconds: &secs, AcquireTime: &now, RenewTime: &now, LeaseTransitions: &transitions,
	}
	clearRecord(lease)
	if lease.Annotations == nil {
		lease.Annotations = map[string]string{}
	}
	lease.Annotations[annotationOperation] = string(op)
	lease.Annotations[annotationNode] = node
	lease.Annotations[annotationProcess] = s.process
	lease.Annotations[annotationState] = string(Taken)
}

// tryAcquire makes one attempt: true when id now holds the slot, else who holds it.
func (s *Slot) tryAcquire(ctx context.Context, id string, op Operation, node string) (bool, string, error) {
	leases := s.leases()
	now := metav1.NewMicroTime(time.Now())
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		lease = &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: LeaseName, Namespace: s.namespace}}
		s.take(lease, id, op, node, now)
		_, err := leases.Create(ctx, lease, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return false, "", nil
		}
		if err != nil {
			return false, "", fmt.Errorf("creating the control-plane slot: %w", err)
		}
		return true, "", nil
	}
	if err != nil {
		return false, "", fmt.Errorf("reading the control-plane slot: %w", err)
	}
	if h, ok := holderOf(lease); ok {
		switch {
		case h.State == Joining && op == ControlPlaneJoin && h.Node == node:
			// The joining node asks again: its join failed and it starts over.
		case h.State == Joining && expired(lease) && s.journal != nil:
			s.timeout(ctx, lease, "")
			return false, h.String(), nil
		case h.State == Joining || !expired(lease):
			return false, h.String(), nil
		}
	}
	s.take(lease, id, op, node, now)
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	if apierrors.IsConflict(err) {
		return false, "", nil
	}
	if err != nil {
		return false, "", fmt.Errorf("taking the control-plane slot: %w", err)
	}
	return true, "", nil
}

// holderOf returns lease's holder record; false when nobody holds it.
func holderOf(lease *coordinationv1.Lease) (Holder, bool) {
	id := lease.Spec.HolderIdentity
	if id == nil || *id == "" {
		return Holder{}, false
	}
	a := lease.Annotations
	h := Holder{Operation: Operation(a[annotationOperation]), State: State(a[annotationState]), Node: a[annotationNode],
		Process: a[annotationProcess], Address: a[annotationAddress]}
	if node, ok := strings.CutPrefix(*id, joinPrefix); ok {
		h.State, h.Node = Joining, node
	}
	if lease.Spec.AcquireTime != nil {
		h.Since = lease.Spec.AcquireTime.Time
	}
	if at := until(lease); at != nil {
		h.Until = *at
	}
	return h, true
}

// until is when lease's holder loses it without a renewal; nil when it cannot be told.
func until(lease *coordinationv1.Lease) *time.Time {
	s := lease.Spec
	if s.RenewTime == nil || s.LeaseDurationSeconds == nil {
		return nil
	}
	t := s.RenewTime.Add(time.Duration(*s.LeaseDurationSeconds) * time.Second)
	return &t
}

// expired reports whether lease's holder let it run out.
func expired(lease *coordinationv1.Lease) bool {
	at := until(lease)
	return at == nil || !time.Now().Before(*at)
}

// clearRecord removes the holder record's annotations.
func clearRecord(lease *coordinationv1.Lease) {
	for _, k := range []string{annotationOperation, annotationNode, annotationProcess, annotationState, annotationAddress} {
		delete(lease.Annotations, k)
	}
}

// free clears lease's holder.
func free(lease *coordinationv1.Lease) {
	lease.Spec.HolderIdentity = nil
	lease.Spec.RenewTime = nil
	lease.Spec.AcquireTime = nil
	clearRecord(lease)
}

// Locker holds the slot for one operation at a time, for callers that need no more than to hold it
// (the webhook keeper's install.RotationLock).
type Locker struct {
	Slot      *Slot
	Operation Operation
	// Node is what the operation is about (for the webhook's rotation, the webhook's name).
	Node string
}

// Lock acquires the slot (see Acquire: ErrBusy naming the holder after Slot.MaxWait) and returns
// its release.
func (l Locker) Lock(ctx context.Context) (func(), error) {
	h, err := l.Slot.Acquire(ctx, l.Operation, l.Node)
	if err != nil {
		return nil, err
	}
	return h.Release, nil
}

// Held is the slot an Acquire took.
type Held struct {
	s    *Slot
	id   string
	op   Operation
	node string
	// waitedFor is who held the slot when Acquire first found it taken.
	waitedFor string
	// stop ends the renewal loop; renewed is closed when it has ended.
	stop    context.CancelFunc
	renewed chan struct{}
	once    sync.Once
}

// WaitedFor says who held the slot while Acquire waited; empty when it was free.
func (h *Held) WaitedFor() string { return h.waitedFor }

// Release stops the renewals and frees the slot if it is still this Held's. Failures only delay the
// next operation until the slot runs out.
func (h *Held) Release() {
	h.once.Do(func() {
		h.endRenewals()
		h.s.release(h.id)
	})
}

func (h *Held) endRenewals() {
	h.stop()
	<-h.renewed
}

// renewLoop moves the slot's renewTime on every Duration/renewFraction until ctx ends. It stops
// when the slot was taken over; failures are retried at the next tick.
func (h *Held) renewLoop(ctx context.Context) {
	defer close(h.renewed)
	t := time.NewTicker(max(h.s.Duration/renewFraction, 100*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		lost, err := h.renew(ctx)
		if lost {
			h.s.log.Warn("the control-plane slot was taken over while held", zap.String("operation", string(h.op)), zap.String("node", h.node))
			return
		}
		if err != nil && ctx.Err() == nil {
			h.s.log.Debug("renewing the control-plane slot", zap.Error(err))
		}
	}
}

// renew moves renewTime to now; lost when another holder has the slot.
func (h *Held) renew(ctx context.Context) (lost bool, err error) {
	leases := h.s.leases()
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if id := lease.Spec.HolderIdentity; id == nil || *id != h.id {
		return true, nil
	}
	now := metav1.NewMicroTime(time.Now())
	lease.Spec.RenewTime = &now
	_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	return false, err
}

// Joining hands the taken slot to the join of the control plane node at address: it stays joining
// until a replica's Watch sees the join finished or JoinTimeout passed, and Release no longer frees
// it. An error means the slot could not be handed over (the ticket must not be issued).
func (h *Held) Joining(ctx context.Context, node, address string) error {
	h.endRenewals()
	s := h.s
	leases := s.leases()
	lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("reading the control-plane slot: %w", err)
	}
	if id := lease.Spec.HolderIdentity; id == nil || *id != h.id {
		return errors.New("the control-plane slot expired and was taken over while the ticket was made")
	}
	holder := joinPrefix + node
	now := metav1.NewMicroTime(time.Now())
	secs := int32(s.JoinTimeout / time.Second)
	lease.Spec.HolderIdentity = &holder
	lease.Spec.LeaseDurationSeconds = &secs
	lease.Spec.AcquireTime, lease.Spec.RenewTime = &now, &now
	if lease.Annotations == nil {
		lease.Annotations = map[string]string{}
	}
	lease.Annotations[annotationOperation] = string(ControlPlaneJoin)
	lease.Annotations[annotationNode] = node
	lease.Annotations[annotationState] = string(Joining)
	lease.Annotations[annotationAddress] = address
	if _, err := leases.Update(ctx, lease, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("handing the control-plane slot to %s's join: %w", node, err)
	}
	h.once.Do(func() {}) // the join holds it now; Release must not clear it
	s.log.Info("control-plane slot held for the join", zap.String("node", node), zap.String("address", address), zap.Duration("timeout", s.JoinTimeout))
	return nil
}

// release clears the holder if it is still id.
func (s *Slot) release(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	leases := s.leases()
	for range 5 {
		lease, err := leases.Get(ctx, LeaseName, metav1.GetOptions{})
		if err != nil {
			s.log.Warn("releasing the control-plane slot", zap.Error(err))
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
			s.log.Warn("releasing the control-plane slot", zap.Error(err))
			return
		}
	}
}
