package recordwriter_test

import (
	"errors"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
	"github.com/berth-k8s/berth/joinservice/recordwriter"
)

func testTrace(reason string) *v1alpha1.JoinTrace {
	start := metav1.NewTime(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	return &v1alpha1.JoinTrace{Reported: metav1.NewTime(start.Add(time.Minute)), Phases: []v1alpha1.JoinPhase{
		{Name: v1alpha1.PhaseTicket, Start: start, Duration: metav1.Duration{Duration: 2500 * time.Millisecond}, Outcome: v1alpha1.PhaseOutcomeSucceeded},
		{Name: v1alpha1.PhaseJoin, Start: start, Duration: metav1.Duration{Duration: 40 * time.Second}, Outcome: v1alpha1.PhaseOutcomeFailed, Reason: reason},
	}}
}

// TestStoreTraceOnlyOnItsMachine, against a real API server: a trace lands on the Machine of its
// identity and on no other; an identity without a Machine gets ErrNoMachine and no Machine is
// created; the CRD's schema refuses a trace no node may send.
func TestStoreTraceOnlyOnItsMachine(t *testing.T) {
	rc, kc := setup(t)
	ctx := t.Context()
	w := recordwriter.New(rc, kc, ns, "cp1", nil)
	now := time.Now().UTC().Truncate(time.Second)
	for _, id := range []string{identity(1), identity(2)} {
		w.Admit(recordwriter.Admission{Time: now, Identity: id, Node: "w-" + id[:1], Role: "worker", RPC: "join", Peer: "198.51.100.1"})
	}
	w.Flush(ctx, nil)

	name, err := w.StoreTrace(ctx, identity(1), testTrace("KUBEADM_JOIN_FAILED"))
	if err != nil {
		t.Fatal(err)
	}
	if name != records.NameFor(identity(1)) {
		t.Errorf("stored on %s, want %s", name, records.NameFor(identity(1)))
	}
	machines := rc.RecordsV1alpha1().Machines(ns)
	m1, err := machines.Get(ctx, records.NameFor(identity(1)), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tr := m1.Status.JoinTrace
	if tr == nil || len(tr.Phases) != 2 || tr.Phases[0].Duration.Duration != 2500*time.Millisecond || tr.Phases[1].Reason != "KUBEADM_JOIN_FAILED" {
		t.Fatalf("machine 1's trace = %+v", tr)
	}
	if m1.Status.State != v1alpha1.StateAdmitted || m1.Status.LastJoin == nil {
		t.Errorf("storing the trace changed the rest of the status: %+v", m1.Status)
	}
	m2, err := machines.Get(ctx, records.NameFor(identity(2)), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if m2.Status.JoinTrace != nil {
		t.Errorf("machine 2 got a trace it never sent: %+v", m2.Status.JoinTrace)
	}

	_, err = w.StoreTrace(ctx, identity(3), testTrace(""))
	if !errors.Is(err, recordwriter.ErrNoMachine) {
		t.Fatalf("StoreTrace without a machine = %v, want ErrNoMachine", err)
	}
	if _, err := machines.Get(ctx, records.NameFor(identity(3)), metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("a machine was created for a trace: %v", err)
	}

	// The schema bounds what any writer stores: a reason that is not a code is refused.
	if _, err := w.StoreTrace(ctx, identity(2), testTrace("not a code\x1b")); !apierrors.IsInvalid(err) {
		t.Errorf("StoreTrace of a bad reason = %v, want Invalid from the API server", err)
	}
}
