package ledger

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

const ns = "berth-system"

// runWriter runs w until the test ends.
func runWriter(t *testing.T, w *Writer) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
}

// advance lets d pass in the test's synctest bubble and returns once every goroutine in it (the
// writer) is blocked again: whatever the writer does within d has been done.
func advance(d time.Duration) {
	time.Sleep(d)
	synctest.Wait()
}

// entries returns the ledger's entries through c.
func entries(t *testing.T, c kubernetes.Interface) []Entry {
	t.Helper()
	es, err := joinledger.Read(context.Background(), c, ns)
	if err != nil {
		t.Fatal(err)
	}
	return es
}

func entry(i int, outcome string) Entry {
	e := Entry{Time: time.Unix(1700000000, int64(i)), Peer: fmt.Sprintf("198.51.100.%d", i%250), Node: fmt.Sprintf("worker-%d", i), Role: "worker", RPC: "join", Outcome: outcome}
	if outcome == OutcomeRejected {
		e.Reason, e.Message = "MEASUREMENT_MISMATCH", "index 4: expected 00, actual 11"
	}
	return e
}

func TestRecordNeverBlocksAndCountsDrops(t *testing.T) {
	w := NewWriter(fake.NewClientset(), ns, "cp-0", zap.NewNop()) // not running: nothing drains
	for i := range QueueSize + 10 {
		w.Record(entry(i, OutcomeAccepted))
	}
	if got := w.Dropped(); got != 10 {
		t.Fatalf("Dropped() = %d, want 10", got)
	}
}

func TestRateLimitedAreAggregatedPerPeer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		w := NewWriter(c, ns, "cp-0", zap.NewNop())
		for range 1000 {
			w.RecordRateLimited("203.0.113.5")
		}
		w.RecordRateLimited("203.0.113.6")
		w.Record(entry(1, OutcomeRejected))
		runWriter(t, w)
		advance(FlushInterval)
		es := entries(t, c)
		counts := map[string]int{}
		for _, e := range es {
			if e.Reason == ReasonRateLimited {
				counts[e.Peer] = e.Count
			}
		}
		if counts["203.0.113.5"] != 1000 || counts["203.0.113.6"] != 1 || len(es) != 3 {
			t.Fatalf("entries %+v", es)
		}
	})
}

func TestConflictIsRetriedWithoutLosingEntries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: ns}})
		var mu sync.Mutex
		conflicts := 0
		c.PrependReactor("update", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
			mu.Lock()
			defer mu.Unlock()
			if conflicts < 2 {
				conflicts++
				// Another replica got there first.
				cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: ns}, Data: map[string]string{}}
				prev, _ := c.Tracker().Get(schema.GroupVersionResource{Version: "v1", Resource: "configmaps"}, ns, joinledger.ConfigMapName)
				es, _ := joinledger.Decode(prev.(*corev1.ConfigMap).Data[joinledger.DataKey])
				es = append(es, entry(100+conflicts, OutcomeAccepted))
				b, _ := json.Marshal(es)
				cm.Data[joinledger.DataKey] = string(b)
				_ = c.Tracker().Update(schema.GroupVersionResource{Version: "v1", Resource: "configmaps"}, cm, ns)
				return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "configmaps"}, joinledger.ConfigMapName, fmt.Errorf("the object has been modified"))
			}
			return false, nil, nil
		})
		w := NewWriter(c, ns, "cp-0", zap.NewNop())
		w.Record(entry(1, OutcomeRejected))
		w.Record(entry(2, OutcomeAccepted))
		runWriter(t, w)
		advance(FlushInterval)
		if es := entries(t, c); len(es) != 4 {
			t.Fatalf("entries %+v", es)
		}
		// Events follow the ConfigMap write.
		evs, err := c.CoreV1().Events(ns).List(context.Background(), metav1.ListOptions{})
		if err != nil || len(evs.Items) != 2 {
			t.Fatalf("events: %v %v", evs, err)
		}
	})
}

// TestFloodKeepsTheEvidence: a flood of unverified refusals from thousands of peers, recorded after
// accepted joins and cryptographic failures, leaves every one of those in the ledger; refusals are
// aggregated per peer and reason, and a full table of unverified refusals does not stop evidence from
// being recorded.
func TestFloodKeepsTheEvidence(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		w := NewWriter(c, ns, "cp-0", zap.NewNop())
		runWriter(t, w)
		for i := range 30 {
			w.Record(Entry{Time: time.Now(), Peer: fmt.Sprintf("198.51.100.%d", i), Node: fmt.Sprintf("worker-%d", i), RPC: "join",
				Outcome: OutcomeAccepted, Kind: joinledger.KindAccepted})
		}
		for i := range 5 {
			w.Record(Entry{Time: time.Now(), Peer: fmt.Sprintf("198.51.100.%d", 100+i), RPC: "handshake", Outcome: OutcomeRejected,
				Reason: "NONCE_MISMATCH", Kind: joinledger.KindEvidence})
		}
		advance(FlushInterval)
		// The flood: 4 rounds of claim refusals from 2000 addresses, and rate-limited attempts.
		for round := range 4 {
			for i := range 2000 {
				w.Record(Entry{Time: time.Now(), Peer: fmt.Sprintf("127.0.%d.%d", i/250, i%250), RPC: "handshake", Outcome: OutcomeRejected,
					Reason: "MEASUREMENT_MISMATCH", Message: "claimed measurements", Kind: joinledger.KindUnverified})
				w.RecordRateLimited(fmt.Sprintf("127.0.%d.%d", i/250, i%250))
			}
			// Evidence recorded while the unverified table is full still lands.
			if round == 3 {
				w.Record(Entry{Time: time.Now(), Peer: "198.51.100.200", RPC: "handshake", Outcome: OutcomeRejected,
					Reason: "KEY_BINDING", Kind: joinledger.KindEvidence})
			}
			advance(FloodInterval + FlushInterval)
		}
		es := entries(t, c)
		kinds := map[string]int{}
		keyBinding := false
		for _, e := range es {
			kinds[joinledger.KindOf(e)]++
			keyBinding = keyBinding || e.Reason == "KEY_BINDING"
		}
		if kinds[joinledger.KindAccepted] != 30 || kinds[joinledger.KindEvidence] != 6 || !keyBinding {
			t.Fatalf("after the flood the ledger holds %v (KEY_BINDING: %v); want all 30 accepted joins and 6 cryptographic failures", kinds, keyBinding)
		}
		if len(es) != Capacity {
			t.Fatalf("%d entries, want the full %d", len(es), Capacity)
		}
		if w.Dropped() == 0 {
			t.Fatal("the flood filled no table: this test no longer floods")
		}
	})
}

// TestConcurrentReplicasOnAPIServer runs three writers against a real API server at once; every
// entry of every replica must land, and each batch gets its Events.
func TestConcurrentReplicasOnAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	admin := env.Client(t, apiservertest.AdminUser)
	// A namespace of its own each run (-count): the test API server runs no namespace controller, so
	// a deleted one never goes away.
	created, err := admin.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "ledger-concurrent-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	testNS := created.Name
	const replicas, perReplica = 3, 40
	for r := range replicas {
		w := NewWriter(admin, testNS, fmt.Sprintf("cp-%d", r), zap.NewNop())
		runWriter(t, w)
		go func() {
			for i := range perReplica {
				e := entry(r*perReplica+i, OutcomeAccepted)
				if i%4 == 0 {
					e = entry(r*perReplica+i, OutcomeRejected)
				}
				w.Record(e)
			}
		}()
	}
	var es []Entry
	_ = wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		es, _ = joinledger.Read(ctx, admin, testNS)
		return len(es) >= replicas*perReplica, nil
	})
	seen := map[string]bool{}
	for _, e := range es {
		seen[e.Node] = true
	}
	if len(seen) != replicas*perReplica {
		t.Fatalf("ledger holds %d distinct entries, want %d", len(seen), replicas*perReplica)
	}
	// The writers create a batch's Events after merging it into the ConfigMap.
	var evs *corev1.EventList
	var listErr error
	if err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		evs, listErr = admin.CoreV1().Events(testNS).List(ctx, metav1.ListOptions{FieldSelector: "reason=JoinRejected"})
		return listErr == nil && len(evs.Items) > 0, nil
	}); err != nil {
		if listErr != nil {
			t.Fatalf("listing JoinRejected events: %v", listErr)
		}
		t.Fatal("no JoinRejected events")
	}
	t.Logf("%d entries, %d JoinRejected events; example: %s", len(es), len(evs.Items), evs.Items[0].Message)
}

// TestFloodSlowsConfigMapWrites: after a full batch the writer waits FloodInterval before it writes
// the ConfigMap again, and then writes what came meanwhile.
func TestFloodSlowsConfigMapWrites(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		var mu sync.Mutex
		writes := 0
		c.PrependReactor("*", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
			if a.GetVerb() == "create" || a.GetVerb() == "update" {
				mu.Lock()
				writes++
				mu.Unlock()
			}
			return false, nil, nil
		})
		count := func() int { mu.Lock(); defer mu.Unlock(); return writes }
		w := NewWriter(c, ns, "cp-0", zap.NewNop())
		for i := range Capacity + 10 {
			w.Record(entry(i, OutcomeAccepted))
		}
		runWriter(t, w)
		advance(FlushInterval)
		if es := entries(t, c); len(es) != Capacity {
			t.Fatalf("first write holds %d entries, want %d", len(es), Capacity)
		}
		first := count()
		w.Record(entry(100000, OutcomeRejected))
		advance(FloodInterval - FlushInterval)
		if got := count(); got != first {
			t.Fatalf("ConfigMap written %d times within the flood interval, want %d", got, first)
		}
		advance(2 * FlushInterval)
		if es := entries(t, c); es[len(es)-1].Node != "worker-100000" {
			t.Fatal("the entry recorded during the flood interval was not written after it")
		}
	})
}

// TestFailedWriteIsRetriedWithBackoff: while the API server refuses writes, the writer waits longer
// before each retry (retryInitial, doubling); once a write succeeds, the entries are in the ledger.
func TestFailedWriteIsRetriedWithBackoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := fake.NewClientset()
		var attempts []time.Time
		c.PrependReactor("create", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
			attempts = append(attempts, time.Now())
			if len(attempts) <= 4 {
				return true, nil, apierrors.NewServiceUnavailable("etcd is down")
			}
			return false, nil, nil
		})
		w := NewWriter(c, ns, "cp-0", zap.NewNop())
		w.Record(entry(1, OutcomeRejected))
		runWriter(t, w)
		advance(time.Minute)
		if es := entries(t, c); len(es) != 1 {
			t.Fatalf("entries %+v", es)
		}
		if len(attempts) != 5 {
			t.Fatalf("%d write attempts, want 5", len(attempts))
		}
		for i, want := 1, retryInitial; i < len(attempts); i, want = i+1, 2*want {
			// The writer retries at its next tick after waiting.
			if gap := attempts[i].Sub(attempts[i-1]); gap < want || gap > want+FlushInterval {
				t.Errorf("retry %d came %v after the failed write, want %v to %v", i, gap, want, want+FlushInterval)
			}
		}
	})
}
