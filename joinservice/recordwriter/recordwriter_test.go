package recordwriter_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

const ns = joinconfig.Namespace

// setup installs Berth once and returns clients acting as the joinservice, after deleting what
// earlier tests wrote.
func setup(t *testing.T) (clientset.Interface, kubernetes.Interface) {
	t.Helper()
	e := apiservertest.Shared(t)
	ctx := t.Context()
	if err := e.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	cfg := e.Config(apiservertest.JoinServiceUser)
	rc, err := clientset.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	kc, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	admin, err := clientset.NewForConfig(e.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	if err := admin.RecordsV1alpha1().Machines(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := admin.RecordsV1alpha1().JoinRecords(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	return rc, kc
}

func identity(n byte) string { return strings.Repeat(string("0123456789abcdef"[n%16]), 64) }

// TestAdmitWritesOneMachine: an admission creates the machine's Machine in one request; a later
// join of the same machine patches its latest join and evidence and keeps its first admission.
func TestAdmitWritesOneMachine(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	first := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	ev := recordwriter.NewEvidence(strings.Repeat("ab", 32), "tpm", map[uint32][]byte{4: {0xaa}, 9: {0xbb}})
	w.Admit(recordwriter.Admission{Time: first, Identity: identity(1), Node: "w1", Role: "worker", RPC: "join", Peer: "198.51.100.1", Evidence: ev})
	w.Flush(ctx, nil)
	if got := w.Requests(); got != 1 {
		t.Errorf("a new machine took %d requests, want 1", got)
	}
	later := first.Add(30 * time.Minute)
	ev2 := recordwriter.NewEvidence(strings.Repeat("cd", 32), "tpm", map[uint32][]byte{4: {0xcc}})
	w.Admit(recordwriter.Admission{Time: later, Identity: identity(1), Node: "w1", Role: "worker", RPC: "rejoin", Peer: "198.51.100.1", Evidence: ev2})
	w.Flush(ctx, nil)
	if got := w.Requests(); got != 3 {
		t.Errorf("a known machine took %d requests, want 2", got-1)
	}
	m, err := rc.RecordsV1alpha1().Machines(ns).Get(ctx, records.NameFor(identity(1)), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !m.Status.Admitted.Time.Equal(first) || !m.Status.LastJoin.Time.Time.Equal(later) || m.Status.LastJoin.RPC != "rejoin" || m.Status.LastJoin.Replica != "cp1" {
		t.Errorf("status = %+v, want admitted %v and a rejoin at %v by cp1", m.Status, first, later)
	}
	if m.Status.Evidence == nil || m.Status.Evidence.SHA256 != strings.Repeat("cd", 32) || len(m.Status.Evidence.Measurements) != 1 || m.Status.Evidence.Measurements["4"] != "cc" {
		t.Errorf("evidence = %+v, want the rejoin's", m.Status.Evidence)
	}
}

// TestRefusalsAggregate: refusals with one key become one JoinRecord whose count grows across
// flushes; another reason gets its own record.
func TestRefusalsAggregate(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	e := joinledger.Entry{Time: time.Now().UTC(), Peer: "198.51.100.2", RPC: "join", Node: "w2", Outcome: joinledger.OutcomeRejected,
		Reason: "MEASUREMENT_MISMATCH", Message: "pcr 4", Kind: joinledger.KindEvidence, Identity: identity(2), EvidenceSHA256: strings.Repeat("ef", 32)}
	for range 3 {
		w.Record(e)
	}
	w.Flush(ctx, nil)
	w.Record(e)
	e2 := e
	e2.Reason = "DISK_BINDING"
	w.Record(e2)
	w.Flush(ctx, nil)
	list, err := rc.RecordsV1alpha1().JoinRecords(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	for _, jr := range list.Items {
		counts[jr.Spec.Reason] = jr.Status.Count
		if jr.Spec.Class != v1alpha1.ClassEvidence || jr.Spec.Identity != identity(2) || jr.Status.EvidenceSHA256 != e.EvidenceSHA256 {
			t.Errorf("record %+v lost the refused machine's evidence", jr)
		}
	}
	if counts["MEASUREMENT_MISMATCH"] != 4 || counts["DISK_BINDING"] != 1 || len(counts) != 2 {
		t.Errorf("counts = %v, want MEASUREMENT_MISMATCH 4, DISK_BINDING 1", counts)
	}
}

// TestUnverifiedFloodKeepsEvidence: a flood of unverified refusals from many addresses fills its
// class's quota and then folds into the overflow record; the refusal of an attested machine that
// comes after it still gets its own record.
func TestUnverifiedFloodKeepsEvidence(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	saved := records.ClassQuota[v1alpha1.ClassUnverified]
	records.ClassQuota[v1alpha1.ClassUnverified] = 5
	t.Cleanup(func() { records.ClassQuota[v1alpha1.ClassUnverified] = saved })
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	for i := range 40 {
		w.RecordRateLimited("203.0.113." + string(rune('0'+i%10)) + string(rune('0'+i/10)))
	}
	w.Flush(ctx, nil)
	w.Record(joinledger.Entry{Time: time.Now().UTC(), Peer: "198.51.100.3", RPC: "join", Node: "w3", Outcome: joinledger.OutcomeRejected,
		Reason: "MEASUREMENT_MISMATCH", Kind: joinledger.KindEvidence, Identity: identity(3)})
	w.Flush(ctx, nil)
	list, err := rc.RecordsV1alpha1().JoinRecords(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var unverified, overflowCount int64
	evidence := false
	for _, jr := range list.Items {
		switch {
		case jr.Spec.Class == v1alpha1.ClassEvidence && jr.Spec.Identity == identity(3):
			evidence = true
		case jr.Spec.Peer == records.OverflowPeer:
			overflowCount = jr.Status.Count
			unverified++
		case jr.Spec.Class == v1alpha1.ClassUnverified:
			unverified++
		}
	}
	if !evidence {
		t.Error("the attested machine's refusal has no record after the flood")
	}
	if unverified != 6 || overflowCount != 35 {
		t.Errorf("%d unverified records with %d refusals in the overflow, want 5 and the overflow with 35", unverified, overflowCount)
	}
}

// TestSyncRemovalsMigratesAndMirrors: the first sync creates the Machines of the ConfigMap record
// (the migration), later ones copy removals and re-admissions onto them.
func TestSyncRemovalsMigratesAndMirrors(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	at := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	removed := &machines.Removal{Time: at.Add(time.Minute)}
	pending := &machines.Removal{Time: at.Add(2 * time.Minute), Etcd: machines.EtcdPending}
	ms := []machines.Machine{
		{Identity: identity(4), Node: "w4", Role: machines.RoleWorker, Admitted: at},
		{Identity: identity(5), Node: "w5", Role: machines.RoleWorker, Admitted: at, Removal: removed},
		{Identity: "instance/cp6", Node: "cp6", Role: machines.RoleControlPlane, Admitted: at, Removal: pending},
	}
	w.SyncRemovals(ms)
	w.Flush(ctx, nil)
	want := map[string]v1alpha1.MachineState{"w4": v1alpha1.StateAdmitted, "w5": v1alpha1.StateRemoved, "cp6": v1alpha1.StateLocked}
	check := func() {
		t.Helper()
		list, err := rc.RecordsV1alpha1().Machines(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]v1alpha1.MachineState{}
		for _, m := range list.Items {
			got[m.Spec.Node] = m.Status.State
		}
		if len(got) != len(want) {
			t.Errorf("machines = %v, want %v", got, want)
		}
		for n, s := range want {
			if got[n] != s {
				t.Errorf("machine %s is %q, want %q", n, got[n], s)
			}
		}
	}
	check()
	// w4 removed, w5 re-admitted, cp6's etcd member removed.
	ms[0].Removal = &machines.Removal{Time: at.Add(3 * time.Minute)}
	ms[1].Removal = nil
	ms[2].Removal = &machines.Removal{Time: pending.Time, Etcd: machines.EtcdRemoved}
	before := w.Requests()
	w.SyncRemovals(ms)
	w.Flush(ctx, nil)
	if n := w.Requests() - before; n != 3 {
		t.Errorf("three changed machines took %d requests, want 3", n)
	}
	want = map[string]v1alpha1.MachineState{"w4": v1alpha1.StateRemoved, "w5": v1alpha1.StateAdmitted, "cp6": v1alpha1.StateRemoved}
	check()
	// An unchanged record writes nothing.
	before = w.Requests()
	w.SyncRemovals(ms)
	w.Flush(ctx, nil)
	if n := w.Requests() - before; n != 0 {
		t.Errorf("an unchanged record took %d requests", n)
	}
}

// TestRunEmitsEvents: Run writes what it is given and reports it through the events API, regarding
// the Machine.
func TestRunEmitsEvents(t *testing.T) {
	rc, kc := setup(t)
	adminKube, err := kubernetes.NewForConfig(apiservertest.Shared(t).Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	w.Admit(recordwriter.Admission{Time: time.Now(), Identity: identity(7), Node: "w7", Role: "worker", RPC: "join", Peer: "198.51.100.7"})
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		evs, err := adminKube.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		for _, e := range evs.Items {
			if e.Regarding.Kind == records.MachineKind && e.Regarding.Name == records.NameFor(identity(7)) && e.Reason == "JoinAccepted" {
				return true, nil
			}
		}
		return false, nil
	})
	cancel()
	if err != nil {
		t.Fatalf("no JoinAccepted event regarding the Machine: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestJoinAfterReadmissionClearsRemoval: a machine whose Machine still says Removed joins again
// (it was re-admitted): its Machine is Admitted again, without a removal time.
func TestJoinAfterReadmissionClearsRemoval(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	at := time.Now().UTC().Add(-time.Hour).Truncate(time.Second)
	w.SyncRemovals([]machines.Machine{{Identity: identity(8), Node: "w8", Role: machines.RoleWorker, Admitted: at, Removal: &machines.Removal{Time: at}}})
	w.Flush(ctx, nil)
	w.Admit(recordwriter.Admission{Time: time.Now(), Identity: identity(8), Node: "w8", Role: "worker", RPC: "join", Peer: "198.51.100.8"})
	w.Flush(ctx, nil)
	m, err := rc.RecordsV1alpha1().Machines(ns).Get(ctx, records.NameFor(identity(8)), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if m.Status.State != v1alpha1.StateAdmitted || m.Status.Removed != nil || m.Status.LastJoin == nil {
		t.Errorf("status = %+v, want Admitted with the join and no removal", m.Status)
	}
	if w.Dropped() != 0 {
		t.Errorf("dropped %d", w.Dropped())
	}
}
