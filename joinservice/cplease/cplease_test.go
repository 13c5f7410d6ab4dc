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
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/joinservice/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

func TestHeldLeaseMakesOthersWaitThenBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "cp-0", zap.NewNop()), New(c, "ns", "cp-1", zap.NewNop())
		unlock, err := a.Lock(context.Background(), "cp-2")
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if _, err := b.Lock(context.Background(), "cp-3"); !errors.Is(err, server.ErrControlPlaneBusy) {
			t.Fatalf("Lock() while held = %v, want ErrControlPlaneBusy", err)
		}
		if waited := time.Since(start); waited != DefaultMaxWait {
			t.Fatalf("Lock() gave up after %v, want %v", waited, DefaultMaxWait)
		}
		unlock()
		lease, err := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if err != nil || lease.Spec.HolderIdentity != nil {
			t.Fatalf("lease after release: %+v %v", lease, err)
		}
		unlock, err = b.Lock(context.Background(), "cp-3")
		if err != nil {
			t.Fatalf("Lock() after release = %v", err)
		}
		unlock()
	})
}

func TestExpiredLeaseIsTakenOver(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		a, b := New(c, "ns", "cp-0", zap.NewNop()), New(c, "ns", "cp-1", zap.NewNop())
		if _, err := a.Lock(context.Background(), "cp-2"); err != nil { // never released: the replica died
			t.Fatal(err)
		}
		time.Sleep(DefaultTTL + time.Second)
		start := time.Now()
		unlock, err := b.Lock(context.Background(), "cp-3")
		if err != nil {
			t.Fatalf("Lock() on an expired lease = %v", err)
		}
		if waited := time.Since(start); waited != 0 {
			t.Fatalf("Lock() on an expired lease waited %v", waited)
		}
		unlock()
		lease, _ := c.CoordinationV1().Leases("ns").Get(context.Background(), LeaseName, metav1.GetOptions{})
		if lease.Spec.LeaseTransitions == nil || *lease.Spec.LeaseTransitions != 1 {
			t.Fatalf("transitions %v", lease.Spec.LeaseTransitions)
		}
	})
}

// TestReplicasSerializeOnAPIServer runs three replicas, with the joinservice's RBAC identity, each
// letting several control planes join at once: no two critical sections overlap, and inside each the
// Lease names its holder.
func TestReplicasSerializeOnAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	if err := env.InstallBerth(context.Background(), "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	client := env.Client(t, apiservertest.JoinServiceUser)
	var inside, maxInside, done atomic.Int32
	var wg sync.WaitGroup
	for r := range 3 {
		l := New(client, joinconfig.Namespace, fmt.Sprintf("cp-%d", r), zap.NewNop())
		l.MaxWait = 60 * time.Second
		for n := range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				joiner := fmt.Sprintf("joiner-%d-%d", r, n)
				unlock, err := l.Lock(context.Background(), joiner)
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
				unlock()
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
