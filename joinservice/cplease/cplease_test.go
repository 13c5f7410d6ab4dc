package cplease

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinservice/server"
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

func TestHeldLeaseMakesOthersWaitThenBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "cp-0", nil, zap.NewNop()), New(c, "ns", "cp-1", nil, zap.NewNop())
		slot, err := a.Lock(context.Background(), "cp-2")
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err = b.Lock(context.Background(), "cp-3")
		if !errors.Is(err, server.ErrControlPlaneBusy) || !strings.Contains(err.Error(), "replica cp-0 holds the control-plane slot for cp-2") {
			t.Fatalf("Lock() while held = %v, want ErrControlPlaneBusy naming the holder", err)
		}
		if waited := time.Since(start); waited != DefaultMaxWait {
			t.Fatalf("Lock() gave up after %v, want %v", waited, DefaultMaxWait)
		}
		slot.Release()
		lease, err := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity != nil {
			t.Fatalf("lease after release: %+v %v", lease, err)
		}
		slot, err = b.Lock(context.Background(), "cp-3")
		if err != nil {
			t.Fatalf("Lock() after release = %v", err)
		}
		slot.Release()
	})
}

func TestExpiredLeaseIsTakenOver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "cp-0", nil, zap.NewNop()), New(c, "ns", "cp-1", nil, zap.NewNop())
		if _, err := a.Lock(context.Background(), "cp-2"); err != nil { // never released: the replica died
			t.Fatal(err)
		}
		time.Sleep(DefaultTTL + time.Second)
		start := time.Now()
		slot, err := b.Lock(context.Background(), "cp-3")
		if err != nil {
			t.Fatalf("Lock() on an expired lease = %v", err)
		}
		if waited := time.Since(start); waited != 0 {
			t.Fatalf("Lock() on an expired lease waited %v", waited)
		}
		slot.Release()
		lease, _ := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if lease.Spec.LeaseTransitions == nil || *lease.Spec.LeaseTransitions != 1 {
			t.Fatalf("transitions %v", lease.Spec.LeaseTransitions)
		}
	})
}

// TestJoiningLeaseOutlivesTheTicket: a slot handed to a join is not released by the ticket's end,
// keeps others out well past the TTL, lets the joining node itself take it again, and, with nobody
// watching, is freed by the next Lock once the join timeout passed, which records the timeout.
func TestJoiningLeaseOutlivesTheTicket(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		j := &journal{}
		a, b := New(c, "ns", "cp-0", nil, zap.NewNop()), New(c, "ns", "cp-1", j, zap.NewNop())
		slot, err := a.Lock(context.Background(), "cp-2")
		if err != nil {
			t.Fatal(err)
		}
		if err := slot.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
			t.Fatal(err)
		}
		slot.Release() // the ticket's call ends: the join keeps the slot
		lease, _ := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if h := lease.Spec.HolderIdentity; h == nil || *h != "join/cp-2" || lease.Annotations[annotationAddress] != "198.51.100.12" || lease.Annotations[annotationReplica] != "cp-0" {
			t.Fatalf("lease after the ticket: holder %v, annotations %v", h, lease.Annotations)
		}
		time.Sleep(DefaultTTL + time.Second)
		if _, err := b.Lock(context.Background(), "cp-3"); !errors.Is(err, server.ErrControlPlaneBusy) || !strings.Contains(err.Error(), "control plane cp-2 is joining") {
			t.Fatalf("Lock() while cp-2 joins = %v, want busy naming cp-2's join", err)
		}
		again, err := b.Lock(context.Background(), "cp-2")
		if err != nil {
			t.Fatalf("cp-2 asking again = %v, want the slot", err)
		}
		if err := again.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
			t.Fatal(err)
		}
		time.Sleep(DefaultJoinTimeout)
		s3, err := b.Lock(context.Background(), "cp-3")
		if err != nil {
			t.Fatalf("Lock() after the join timeout = %v", err)
		}
		if !strings.Contains(s3.WaitedFor(), "control plane cp-2 is joining") {
			t.Fatalf("WaitedFor() = %q, want cp-2's join", s3.WaitedFor())
		}
		s3.Release()
		es := j.all()
		if len(es) != 1 || es[0].Reason != joinledger.ReasonControlPlaneJoinTimeout || es[0].Node != "cp-2" || es[0].RPC != joinledger.RPCControlPlaneJoin ||
			es[0].Outcome != joinledger.OutcomeRejected || es[0].Peer != "198.51.100.12" || es[0].TicketIssued.IsZero() {
			t.Fatalf("ledger %+v, want cp-2's join timeout", es)
		}
	})
}

// observer answers JoinDone from a flag.
type observer struct {
	done  atomic.Bool
	calls atomic.Int32
}

func (o *observer) JoinDone(_ context.Context, node, address string) (bool, string) {
	o.calls.Add(1)
	if o.done.Load() {
		return true, fmt.Sprintf("etcd member %s voting and healthy, API server at %s ready", node, address)
	}
	return false, "etcd member " + node + " is a learner"
}

func joinServiceClient(t *testing.T) kubernetes.Interface {
	t.Helper()
	env := apiservertest.Shared(t)
	// Each test starts from a free slot: the admin deletes the Lease (the joinservice may not) and
	// InstallBerth creates it again, unheld (the joinservice may not create it either).
	err := env.Client(t, apiservertest.AdminUser).CoordinationV1().Leases(joinconfig.Namespace).Delete(context.Background(), LeaseName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if err := env.InstallBerth(context.Background(), "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	return env.Client(t, apiservertest.JoinServiceUser)
}

func runWatch(t *testing.T, l *Lock, obs Observer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Watch(ctx, obs) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Watch: %v", err)
		}
	})
}

// waitRecorded waits until the journals hold an entry and returns what they hold: a replica frees
// the slot before it records the join's end.
func waitRecorded(t *testing.T, journals ...*journal) []joinledger.Entry {
	t.Helper()
	var es []joinledger.Entry
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		es = nil
		for _, j := range journals {
			es = append(es, j.all()...)
		}
		return len(es) > 0, nil
	}); err != nil {
		t.Fatal("the slot was freed, but no ledger entry was recorded")
	}
	return es
}

func waitFree(t *testing.T, client kubernetes.Interface, timeout time.Duration) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		lease, err := client.CoordinationV1().Leases(joinconfig.Namespace).Get(ctx, LeaseName, metav1.GetOptions{})
		return err == nil && lease.Spec.HolderIdentity == nil, nil
	}); err != nil {
		t.Fatal("the control-plane slot was never freed")
	}
}

// TestWatchFreesTheSlotWhenJoined: on a real API server, with the joinservice's RBAC identity, a
// join's slot stays taken while the observers see the join unfinished, and is freed by one of the
// replicas (not the one that issued the ticket, which is gone) once it finished, with exactly one
// accepted ledger entry.
func TestWatchFreesTheSlotWhenJoined(t *testing.T) {
	client := joinServiceClient(t)
	ja, jb := &journal{}, &journal{}
	issuer := New(client, joinconfig.Namespace, "cp-0", &journal{}, zaptest.NewLogger(t))
	b, c := New(client, joinconfig.Namespace, "cp-1", ja, zaptest.NewLogger(t)), New(client, joinconfig.Namespace, "cp-3", jb, zaptest.NewLogger(t))
	b.MaxWait, c.MaxWait = time.Second, time.Second
	obs := &observer{}
	runWatch(t, b, obs)
	runWatch(t, c, obs)
	slot, err := issuer.Lock(context.Background(), "cp-2")
	if err != nil {
		t.Fatal(err)
	}
	if err := slot.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return obs.calls.Load() >= 2, nil
	}); err != nil {
		t.Fatal("the watchers never observed the join")
	}
	if _, err := b.Lock(context.Background(), "cp-4"); !errors.Is(err, server.ErrControlPlaneBusy) {
		t.Fatalf("Lock() while cp-2's join is unfinished = %v, want busy", err)
	}
	obs.done.Store(true)
	waitFree(t, client, 30*time.Second)
	es := waitRecorded(t, ja, jb)
	if len(es) != 1 || es[0].Outcome != joinledger.OutcomeAccepted || es[0].RPC != joinledger.RPCControlPlaneJoin || es[0].Node != "cp-2" ||
		!strings.Contains(es[0].Message, "(issued by cp-0)") || !strings.Contains(es[0].Message, "API server at 198.51.100.12 ready") ||
		es[0].TicketIssued.IsZero() || es[0].TicketIssued.After(es[0].Time) {
		t.Fatalf("ledger %+v, want one accepted control-plane-join of cp-2", es)
	}
	s, err := b.Lock(context.Background(), "cp-4")
	if err != nil {
		t.Fatalf("Lock() after cp-2 joined = %v", err)
	}
	if s.WaitedFor() != "" {
		t.Fatalf("WaitedFor() of a free slot = %q", s.WaitedFor())
	}
	s.Release()
}

// TestWatchFreesTheSlotAfterTheJoinTimeout: a join that never finishes holds the slot for the join
// timeout, then a watcher frees it and records the timeout with what it last saw.
func TestWatchFreesTheSlotAfterTheJoinTimeout(t *testing.T) {
	client := joinServiceClient(t)
	j := &journal{}
	l := New(client, joinconfig.Namespace, "cp-1", j, zaptest.NewLogger(t))
	l.JoinTimeout = 3 * time.Second
	runWatch(t, l, &observer{})
	slot, err := l.Lock(context.Background(), "cp-2")
	if err != nil {
		t.Fatal(err)
	}
	if err := slot.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waitFree(t, client, 30*time.Second)
	if held := time.Since(start); held < 2*time.Second {
		t.Fatalf("slot freed after %v, before the join timeout", held)
	}
	es := waitRecorded(t, j)
	if len(es) != 1 || es[0].Reason != joinledger.ReasonControlPlaneJoinTimeout || !strings.Contains(es[0].Message, "last seen: etcd member cp-2 is a learner") {
		t.Fatalf("ledger %+v, want the timeout of cp-2's join with what was last seen", es)
	}
}

// TestReplicasSerializeOnAPIServer runs three replicas, with the joinservice's RBAC identity, each
// letting several control planes join at once: no two critical sections overlap, and inside each the
// Lease names its holder.
func TestReplicasSerializeOnAPIServer(t *testing.T) {
	client := joinServiceClient(t)
	var inside, maxInside, done atomic.Int32
	var wg sync.WaitGroup
	for r := range 3 {
		l := New(client, joinconfig.Namespace, fmt.Sprintf("cp-%d", r), nil, zap.NewNop())
		l.MaxWait = 60 * time.Second
		for n := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				joiner := fmt.Sprintf("joiner-%d-%d", r, n)
				slot, err := l.Lock(context.Background(), joiner)
				if err != nil {
					t.Error(err)
					return
				}
				if v := inside.Add(1); v > maxInside.Load() {
					maxInside.Store(v)
				}
				// The ticket being made: a round trip to the API server, as the real one makes.
				lease, err := client.CoordinationV1().Leases(joinconfig.Namespace).Get(context.Background(), LeaseName, metav1.GetOptions{})
				if err != nil {
					t.Error(err)
				} else if h := lease.Spec.HolderIdentity; h == nil || !strings.HasPrefix(*h, fmt.Sprintf("cp-%d/%s/", r, joiner)) {
					t.Errorf("%s holds the lock, but the Lease names %v", joiner, h)
				}
				inside.Add(-1)
				slot.Release()
				done.Add(1)
			}()
		}
	}
	wg.Wait()
	if maxInside.Load() != 1 || done.Load() != 9 {
		t.Fatalf("%d joins done, at most %d at once; want 9 and 1", done.Load(), maxInside.Load())
	}
	lease, err := client.CoordinationV1().Leases(joinconfig.Namespace).Get(context.Background(), LeaseName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("lease transitions: %d", *lease.Spec.LeaseTransitions)
}
