package cpslot

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

// journal collects ledger entries.
type journal struct {
	mu sync.Mutex
	es []joinledger.Entry
}

func (j *journal) Record(e joinledger.Entry) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.es = append(j.es, e)
}

func (j *journal) all() []joinledger.Entry {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]joinledger.Entry(nil), j.es...)
}

func TestHeldSlotMakesOthersWaitThenBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "cp-0", &journal{}, zap.NewNop()), New(c, "ns", "bootstrapper@cp-1", nil, zap.NewNop())
		held, err := a.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
		if err != nil {
			t.Fatal(err)
		}
		h, ok, err := b.Current(context.Background())
		if err != nil || !ok || h.Operation != ControlPlaneJoin || h.State != Taken || h.Node != "cp-2" || h.Process != "cp-0" ||
			!h.Until.Equal(h.Since.Add(DefaultDuration)) {
			t.Fatalf("Current() = %+v %v %v, want cp-0 holding it for cp-2's join for %s", h, ok, err, DefaultDuration)
		}
		start := time.Now()
		_, err = b.Acquire(context.Background(), CertRenewal, "cp-1")
		if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "cp-0 holds the control-plane slot for the control-plane-join of cp-2") {
			t.Fatalf("Acquire() while held = %v, want ErrBusy naming the holder", err)
		}
		if waited := time.Since(start); waited != DefaultMaxWait {
			t.Fatalf("Acquire() gave up after %v, want %v", waited, DefaultMaxWait)
		}
		held.Release()
		lease, err := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity != nil || len(lease.Annotations) != 0 {
			t.Fatalf("lease after release: %+v %v", lease, err)
		}
		held, err = b.Acquire(context.Background(), CertRenewal, "cp-1")
		if err != nil {
			t.Fatalf("Acquire() after release = %v", err)
		}
		held.Release()
	})
}

// TestLockerHoldsTheSlot: the webhook keeper's Locker holds the slot for its rotation, a renewal
// waits and gets ErrBusy naming it, and the release frees it for the renewal; a Locker finding the
// slot held by a renewal gets ErrBusy naming that.
func TestLockerHoldsTheSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		keeper := Locker{Slot: New(c, "ns", "joinservice-0/cert-keeper", nil, zap.NewNop()), Operation: WebhookCARotation, Node: "berth-webhook"}
		renewal := New(c, "ns", "bootstrapper@cp-1", nil, zap.NewNop())
		unlock, err := keeper.Lock(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		_, err = renewal.Acquire(context.Background(), CertRenewal, "cp-1")
		if !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "joinservice-0/cert-keeper holds the control-plane slot for the webhook-ca-rotation of berth-webhook") {
			t.Fatalf("a renewal's Acquire while the keeper rotates = %v, want ErrBusy naming the rotation", err)
		}
		unlock()
		held, err := renewal.Acquire(context.Background(), CertRenewal, "cp-1")
		if err != nil {
			t.Fatalf("a renewal's Acquire after the rotation = %v", err)
		}
		if _, err := keeper.Lock(context.Background()); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "cert-renewal of cp-1") {
			t.Fatalf("the keeper's Lock during a renewal = %v, want ErrBusy naming the renewal", err)
		}
		held.Release()
	})
}

// TestHolderRenewsWhileAlive: a holder that lives keeps the slot well past its duration.
func TestHolderRenewsWhileAlive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "bootstrapper@cp-0", nil, zap.NewNop()), New(c, "ns", "cp-1", &journal{}, zap.NewNop())
		held, err := a.Acquire(context.Background(), CertRenewal, "cp-0")
		if err != nil {
			t.Fatal(err)
		}
		defer held.Release()
		time.Sleep(3 * DefaultDuration)
		if _, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-2"); !errors.Is(err, ErrBusy) {
			t.Fatalf("Acquire() while a live holder renews = %v, want busy", err)
		}
	})
}

// TestDeadHolderFreesTheSlot: a holder that stops renewing (its context ended, its process died)
// without releasing keeps the slot for its duration, then the next Acquire takes it at once; the dead
// holder's late Release leaves the new holder alone.
func TestDeadHolderFreesTheSlot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "bootstrapper@cp-0", nil, zap.NewNop()), New(c, "ns", "cp-1", &journal{}, zap.NewNop())
		ctx, die := context.WithCancel(context.Background())
		dead, err := a.Acquire(ctx, CertRenewal, "cp-0")
		if err != nil {
			t.Fatal(err)
		}
		die()
		time.Sleep(DefaultDuration / 2)
		if _, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-2"); !errors.Is(err, ErrBusy) {
			t.Fatalf("Acquire() within the dead holder's duration = %v, want busy", err)
		}
		time.Sleep(DefaultDuration/2 - DefaultMaxWait + time.Second)
		start := time.Now()
		held, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
		if err != nil {
			t.Fatalf("Acquire() after the dead holder's duration = %v", err)
		}
		if waited := time.Since(start); waited != 0 {
			t.Fatalf("Acquire() on an expired slot waited %v", waited)
		}
		dead.Release()
		h, ok, _ := b.Current(context.Background())
		if !ok || h.Process != "cp-1" || h.Operation != ControlPlaneJoin {
			t.Fatalf("after the dead holder's Release the slot is %+v (held %v), want cp-1's", h, ok)
		}
		held.Release()
		lease, _ := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if lease.Spec.LeaseTransitions == nil || *lease.Spec.LeaseTransitions != 1 {
			t.Fatalf("transitions %v", lease.Spec.LeaseTransitions)
		}
	})
}

// TestJoiningSlotOutlivesTheTicket: a slot handed to a join is not released by the ticket's end,
// keeps others out well past the holder duration, lets the joining node itself take it again, and,
// with nobody watching, is freed by the next Acquire of a joinservice replica once the join timeout
// passed, which records the timeout.
func TestJoiningSlotOutlivesTheTicket(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		j := &journal{}
		a, b := New(c, "ns", "cp-0", &journal{}, zap.NewNop()), New(c, "ns", "cp-1", j, zap.NewNop())
		held, err := a.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
		if err != nil {
			t.Fatal(err)
		}
		if err := held.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
			t.Fatal(err)
		}
		held.Release() // the ticket's call ends: the join keeps the slot
		h, ok, err := b.Current(context.Background())
		if err != nil || !ok || h.State != Joining || h.Node != "cp-2" || h.Address != "198.51.100.12" || h.Process != "cp-0" ||
			!h.Until.Equal(h.Since.Add(DefaultJoinTimeout)) {
			t.Fatalf("slot after the ticket: %+v %v %v", h, ok, err)
		}
		time.Sleep(DefaultDuration + time.Second)
		if _, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-3"); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "control plane cp-2 is joining") {
			t.Fatalf("Acquire() while cp-2 joins = %v, want busy naming cp-2's join", err)
		}
		again, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
		if err != nil {
			t.Fatalf("cp-2 asking again = %v, want the slot", err)
		}
		if err := again.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(DefaultJoinTimeout)
		s3, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-3")
		if err != nil {
			t.Fatalf("Acquire() after the join timeout = %v", err)
		}
		if !strings.Contains(s3.WaitedFor(), "control plane cp-2 is joining") {
			t.Fatalf("WaitedFor() = %q, want cp-2's join", s3.WaitedFor())
		}
		s3.Release()
		es := j.all()
		if len(es) != 1 || es[0].Reason != joinledger.ReasonControlPlaneJoinTimeout || es[0].Node != "cp-2" || es[0].RPC != joinledger.RPCControlPlaneJoin ||
			es[0].Outcome != joinledger.OutcomeRejected || es[0].Peer != "198.51.100.12" || es[0].TicketIssued.IsZero() ||
			!strings.Contains(es[0].Message, "(issued by cp-1)") {
			t.Fatalf("ledger %+v, want cp-2's join timeout", es)
		}
	})
}

// TestRenewalLeavesAnExpiredJoinToTheJoinservice: a process without a journal (a certificate
// renewal) does not end a join whose timeout passed, so the join ledger misses no end: it waits
// for a replica to end it, and takes the slot once one has.
func TestRenewalLeavesAnExpiredJoinToTheJoinservice(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		j := &journal{}
		replica, renewal := New(c, "ns", "cp-0", j, zap.NewNop()), New(c, "ns", "bootstrapper@cp-1", nil, zap.NewNop())
		held, err := replica.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
		if err != nil {
			t.Fatal(err)
		}
		if err := held.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(DefaultJoinTimeout)
		if _, err := renewal.Acquire(context.Background(), CertRenewal, "cp-1"); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "cp-2 is joining") {
			t.Fatalf("renewal's Acquire() on an expired join = %v, want busy", err)
		}
		if h, ok, _ := renewal.Current(context.Background()); !ok || h.State != Joining || len(j.all()) != 0 {
			t.Fatalf("the renewal ended the join: slot %+v (held %v), ledger %+v", h, ok, j.all())
		}
		// A replica ends the join (its Watch, or as here its next Acquire) and records it.
		next, err := replica.Acquire(context.Background(), EtcdMemberRemoval, "cp-4")
		if err != nil {
			t.Fatalf("replica's Acquire() on an expired join = %v", err)
		}
		next.Release()
		got, err := renewal.Acquire(context.Background(), CertRenewal, "cp-1")
		if err != nil {
			t.Fatalf("renewal's Acquire() once the replica freed the slot = %v", err)
		}
		got.Release()
		if es := j.all(); len(es) != 1 || es[0].Reason != joinledger.ReasonControlPlaneJoinTimeout {
			t.Fatalf("ledger %+v, want the join's timeout", es)
		}
	})
}
