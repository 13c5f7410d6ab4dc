package cpslot

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
)

// observer answers JoinDone from a flag.
type observer struct {
	done  atomic.Bool
	calls atomic.Int32
	// onDone runs once, at the first answer that the join finished.
	onDone func()
	once   sync.Once
}

func (o *observer) JoinDone(_ context.Context, node, address string) (bool, string) {
	o.calls.Add(1)
	if o.done.Load() {
		if o.onDone != nil {
			o.once.Do(o.onDone)
		}
		return true, fmt.Sprintf("etcd member %s voting and healthy, API server at %s ready", node, address)
	}
	return false, "etcd member " + node + " is a learner"
}

// clients returns the joinservice's and the admin's (a control plane's bootstrapper with admin.conf)
// clients of the shared API server, with the slot's Lease free.
func clients(t *testing.T) (joinService, admin kubernetes.Interface) {
	t.Helper()
	env := apiservertest.Shared(t)
	admin = env.Client(t, apiservertest.AdminUser)
	// Each test starts from a free slot: the admin deletes the Lease (the joinservice may not) and
	// InstallBerth creates it again, unheld (the joinservice may not create it either).
	err := admin.CoordinationV1().Leases(joinconfig.Namespace).Delete(context.Background(), LeaseName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	if err := env.InstallBerth(context.Background(), "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	return env.Client(t, apiservertest.JoinServiceUser), admin
}

func runWatch(t *testing.T, s *Slot, obs Observer) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Watch(ctx, obs) }()
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

// events is the order in which the operations of a test ran.
type events struct {
	mu sync.Mutex
	es []string
}

func (e *events) add(s string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.es = append(e.es, s)
}

func (e *events) all() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.es)
}

// TestJoinAndRenewalRunOneAfterTheOther: on a real API server, a control plane's join (a joinservice
// replica with its RBAC identity: ticket, handover to the join, the join's end seen by a watching
// replica) and a certificate renewal's restart (a control plane's bootstrapper as the admin) are
// requested at once, or one while the other holds the slot: they run one after the other, never
// overlapping, and the second names the first as what it waited for.
func TestJoinAndRenewalRunOneAfterTheOther(t *testing.T) {
	for _, first := range []string{"", "join", "renewal"} {
		name := "at once"
		if first != "" {
			name = first + " first"
		}
		t.Run(name, func(t *testing.T) {
			js, admin := clients(t)
			ev := &events{}
			var joinAsked, renewalAsked atomic.Bool
			// askedLong: the other operation asked, and had time for its first look at the slot.
			askedLong := func(asked *atomic.Bool) {
				if err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
					return asked.Load(), nil
				}); err != nil {
					t.Error("the other operation never asked for the slot")
				}
				time.Sleep(2 * time.Second) // its first look is immediate: this only makes the overlap certain
			}
			obs := &observer{onDone: func() { ev.add("join: done") }}
			watcher := New(js, joinconfig.Namespace, "cp-1", &journal{}, zaptest.NewLogger(t))
			runWatch(t, watcher, obs)
			replica := New(js, joinconfig.Namespace, "cp-0", &journal{}, zaptest.NewLogger(t))
			renewal := New(admin, joinconfig.Namespace, "bootstrapper@cp-1", nil, zaptest.NewLogger(t))
			replica.MaxWait, renewal.MaxWait = time.Minute, time.Minute

			start := make(chan struct{})
			ticketIssued, renewalStarted := make(chan struct{}), make(chan struct{})
			var wg sync.WaitGroup
			var waited sync.Map
			wg.Go(func() {
				<-start
				if first == "renewal" {
					<-renewalStarted
				}
				joinAsked.Store(true)
				held, err := replica.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
				if err != nil {
					t.Errorf("join: %v", err)
					return
				}
				waited.Store("join", held.WaitedFor())
				ev.add("join: ticket")
				if h, _, _ := replica.Current(context.Background()); h.Operation != ControlPlaneJoin || h.Node != "cp-2" {
					t.Errorf("during the join's ticket the slot is %+v", h)
				}
				if err := held.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
					t.Errorf("join: %v", err)
				}
				held.Release()
				close(ticketIssued)
				if first != "renewal" {
					askedLong(&renewalAsked)
				}
				obs.done.Store(true) // the join finished: the watcher frees the slot
			})
			wg.Go(func() {
				<-start
				if first == "join" {
					<-ticketIssued
				}
				renewalAsked.Store(true)
				held, err := renewal.Acquire(context.Background(), CertRenewal, "cp-1")
				if err != nil {
					t.Errorf("renewal: %v", err)
					close(renewalStarted)
					return
				}
				waited.Store("renewal", held.WaitedFor())
				ev.add("renewal: restart")
				close(renewalStarted)
				if h, _, _ := renewal.Current(context.Background()); h.Operation != CertRenewal || h.Node != "cp-1" || h.Process != "bootstrapper@cp-1" {
					t.Errorf("during the renewal's restart the slot is %+v", h)
				}
				if first != "join" {
					askedLong(&joinAsked)
				}
				ev.add("renewal: done")
				held.Release()
			})
			close(start)
			wg.Wait()
			waitFree(t, js, 30*time.Second)
			got := ev.all()
			joinFirst := []string{"join: ticket", "join: done", "renewal: restart", "renewal: done"}
			renewalFirst := []string{"renewal: restart", "renewal: done", "join: ticket", "join: done"}
			switch {
			case slices.Equal(got, joinFirst) && first != "renewal":
				w, _ := waited.Load("renewal")
				// The renewal may look while the join holds the slot and before it marks it joining.
				if !strings.Contains(w.(string), "control plane cp-2 is joining") && !strings.Contains(w.(string), "control-plane-join of cp-2") {
					t.Errorf("the renewal waited for %q, want cp-2's join", w)
				}
			case slices.Equal(got, renewalFirst) && first != "join":
				w, _ := waited.Load("join")
				if !strings.Contains(w.(string), "bootstrapper@cp-1 holds the control-plane slot for the cert-renewal of cp-1") {
					t.Errorf("the join waited for %q, want cp-1's renewal", w)
				}
			default:
				t.Fatalf("events %q: the operations overlapped or ran out of order", got)
			}
			t.Logf("order: %q", got)
		})
	}
}

// TestDeadHolderFreesTheSlotOnAPIServer: a renewal whose process dies while it holds the slot
// (it stops renewing and never releases) blocks a joinservice replica for the holder's duration
// only; the replica then takes the slot and names the dead holder as what it waited for.
func TestDeadHolderFreesTheSlotOnAPIServer(t *testing.T) {
	js, admin := clients(t)
	renewal := New(admin, joinconfig.Namespace, "bootstrapper@cp-1", nil, zaptest.NewLogger(t))
	renewal.Duration = 3 * time.Second
	ctx, die := context.WithCancel(context.Background())
	dead, err := renewal.Acquire(ctx, CertRenewal, "cp-1")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * renewal.Duration) // alive: it renews
	h, ok, err := renewal.Current(context.Background())
	if err != nil || !ok || !h.Until.After(time.Now()) {
		t.Fatalf("the live holder's slot %+v (held %v, %v) ran out", h, ok, err)
	}
	die()
	diedAt := time.Now()
	replica := New(js, joinconfig.Namespace, "cp-0", &journal{}, zaptest.NewLogger(t))
	replica.MaxWait = 30 * time.Second
	held, err := replica.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
	if err != nil {
		t.Fatalf("Acquire() after the holder died = %v", err)
	}
	defer held.Release()
	if after := time.Since(diedAt); after > renewal.Duration+5*time.Second {
		t.Errorf("the slot was taken %s after the holder died, want within its duration %s", after, renewal.Duration)
	}
	if !strings.Contains(held.WaitedFor(), "bootstrapper@cp-1 holds the control-plane slot for the cert-renewal of cp-1") {
		t.Errorf("WaitedFor() = %q, want the dead renewal", held.WaitedFor())
	}
	dead.Release() // too late: the new holder keeps it
	if h, ok, _ := replica.Current(context.Background()); !ok || h.Process != "cp-0" {
		t.Fatalf("after the dead holder's Release the slot is %+v (held %v)", h, ok)
	}
}

// TestWatchFreesTheSlotWhenJoined: on a real API server, with the joinservice's RBAC identity, a
// join's slot stays taken while the observers see the join unfinished, and is freed by one of the
// replicas (not the one that issued the ticket, which is gone) once it finished, with exactly one
// accepted ledger entry.
func TestWatchFreesTheSlotWhenJoined(t *testing.T) {
	client, _ := clients(t)
	ja, jb := &journal{}, &journal{}
	issuer := New(client, joinconfig.Namespace, "cp-0", &journal{}, zaptest.NewLogger(t))
	b, c := New(client, joinconfig.Namespace, "cp-1", ja, zaptest.NewLogger(t)), New(client, joinconfig.Namespace, "cp-3", jb, zaptest.NewLogger(t))
	b.MaxWait, c.MaxWait = time.Second, time.Second
	obs := &observer{}
	runWatch(t, b, obs)
	runWatch(t, c, obs)
	held, err := issuer.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
	if err != nil {
		t.Fatal(err)
	}
	if err := held.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return obs.calls.Load() >= 2, nil
	}); err != nil {
		t.Fatal("the watchers never observed the join")
	}
	if _, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-4"); !errors.Is(err, ErrBusy) {
		t.Fatalf("Acquire() while cp-2's join is unfinished = %v, want busy", err)
	}
	obs.done.Store(true)
	waitFree(t, client, 30*time.Second)
	es := waitRecorded(t, ja, jb)
	if len(es) != 1 || es[0].Outcome != joinledger.OutcomeAccepted || es[0].RPC != joinledger.RPCControlPlaneJoin || es[0].Node != "cp-2" ||
		!strings.Contains(es[0].Message, "(issued by cp-0)") || !strings.Contains(es[0].Message, "API server at 198.51.100.12 ready") ||
		es[0].TicketIssued.IsZero() || es[0].TicketIssued.After(es[0].Time) {
		t.Fatalf("ledger %+v, want one accepted control-plane-join of cp-2", es)
	}
	s, err := b.Acquire(context.Background(), ControlPlaneJoin, "cp-4")
	if err != nil {
		t.Fatalf("Acquire() after cp-2 joined = %v", err)
	}
	if s.WaitedFor() != "" {
		t.Fatalf("WaitedFor() of a free slot = %q", s.WaitedFor())
	}
	s.Release()
}

// TestWatchFreesTheSlotAfterTheJoinTimeout: a join that never finishes holds the slot for the join
// timeout, then a watcher frees it and records the timeout with what it last saw.
func TestWatchFreesTheSlotAfterTheJoinTimeout(t *testing.T) {
	client, _ := clients(t)
	j := &journal{}
	s := New(client, joinconfig.Namespace, "cp-1", j, zaptest.NewLogger(t))
	s.JoinTimeout = 3 * time.Second
	runWatch(t, s, &observer{})
	held, err := s.Acquire(context.Background(), ControlPlaneJoin, "cp-2")
	if err != nil {
		t.Fatal(err)
	}
	if err := held.Joining(context.Background(), "cp-2", "198.51.100.12"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	waitFree(t, client, 30*time.Second)
	if d := time.Since(start); d < 2*time.Second {
		t.Fatalf("slot freed after %v, before the join timeout", d)
	}
	es := waitRecorded(t, j)
	if len(es) != 1 || es[0].Reason != joinledger.ReasonControlPlaneJoinTimeout || !strings.Contains(es[0].Message, "last seen: etcd member cp-2 is a learner") {
		t.Fatalf("ledger %+v, want the timeout of cp-2's join with what was last seen", es)
	}
}

// TestReplicasSerializeOnAPIServer runs three replicas, with the joinservice's RBAC identity, each
// letting several control planes join at once: no two critical sections overlap, and inside each the
// slot names its holder.
func TestReplicasSerializeOnAPIServer(t *testing.T) {
	client, _ := clients(t)
	var inside, maxInside, done atomic.Int32
	var wg sync.WaitGroup
	for r := range 3 {
		s := New(client, joinconfig.Namespace, fmt.Sprintf("cp-%d", r), &journal{}, zap.NewNop())
		s.MaxWait = 60 * time.Second
		for n := range 3 {
			wg.Go(func() {
				joiner := fmt.Sprintf("joiner-%d-%d", r, n)
				held, err := s.Acquire(context.Background(), ControlPlaneJoin, joiner)
				if err != nil {
					t.Error(err)
					return
				}
				if v := inside.Add(1); v > maxInside.Load() {
					maxInside.Store(v)
				}
				// The ticket being made: a round trip to the API server, as the real one makes.
				h, ok, err := s.Current(context.Background())
				if err != nil {
					t.Error(err)
				} else if !ok || h.Process != fmt.Sprintf("cp-%d", r) || h.Node != joiner {
					t.Errorf("%s holds the slot, but the Lease names %+v", joiner, h)
				}
				inside.Add(-1)
				held.Release()
				done.Add(1)
			})
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
