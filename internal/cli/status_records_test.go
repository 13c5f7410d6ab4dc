package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/records"
	"github.com/berth-k8s/berth/internal/records/clientset"
	"github.com/berth-k8s/berth/internal/records/v1alpha1"
)

// TestStatusReadsRecords: berth status counts the Machines by state and lists the refusals with
// their reason, escaping what a peer sent; berth status NODE shows the node's machine, latest join,
// evidence and refusals.
func TestStatusReadsRecords(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	rc, err := clientset.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	ns := joinconfig.Namespace
	for _, c := range []func() error{
		func() error {
			return rc.RecordsV1alpha1().Machines(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		},
		func() error {
			return rc.RecordsV1alpha1().JoinRecords(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		},
	} {
		if err := c(); err != nil {
			t.Fatal(err)
		}
	}
	now := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	id := strings.Repeat("7e", 32)
	if _, err := rc.RecordsV1alpha1().Machines(ns).Create(ctx, &v1alpha1.Machine{
		ObjectMeta: metav1.ObjectMeta{Name: records.NameFor(id), Namespace: ns},
		Spec:       v1alpha1.MachineSpec{Identity: id, Node: "w1", Role: "worker"},
		Status: v1alpha1.MachineStatus{State: v1alpha1.StateAdmitted, Admitted: now,
			LastJoin: &v1alpha1.JoinSeen{Time: now, RPC: "join", Peer: "198.51.100.1", Replica: "cp1"},
			Evidence: &v1alpha1.Evidence{SHA256: strings.Repeat("ab", 32), Variant: "tpm", Measurements: map[string]string{"4": "aabb", "15": "ccdd"}},
			JoinTrace: &v1alpha1.JoinTrace{Reported: now, Phases: []v1alpha1.JoinPhase{
				{Name: v1alpha1.PhaseMetadata, Start: now, Duration: metav1.Duration{Duration: 120 * time.Millisecond}, Outcome: v1alpha1.PhaseOutcomeSucceeded},
				{Name: v1alpha1.PhaseTicket, Start: metav1.NewTime(now.Add(time.Second)), Duration: metav1.Duration{Duration: 2500 * time.Millisecond}, Outcome: v1alpha1.PhaseOutcomeSucceeded, Message: "attempt 3\x1b[2J"},
				{Name: v1alpha1.PhaseJoin, Start: metav1.NewTime(now.Add(4 * time.Second)), Duration: metav1.Duration{Duration: 41 * time.Second}, Outcome: v1alpha1.PhaseOutcomeSucceeded},
				{Name: v1alpha1.PhaseReady, Start: metav1.NewTime(now.Add(45 * time.Second)), Duration: metav1.Duration{Duration: 5 * time.Minute}, Outcome: v1alpha1.PhaseOutcomeFailed, Reason: "NODE_NOT_READY"},
			}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	spec := v1alpha1.JoinRecordSpec{Class: v1alpha1.ClassEvidence, Identity: strings.Repeat("5d", 32), Peer: "198.51.100.2", Node: "w2", RPC: "join", Reason: "MEASUREMENT_MISMATCH"}
	if _, err := rc.RecordsV1alpha1().JoinRecords(ns).Create(ctx, &v1alpha1.JoinRecord{
		ObjectMeta: metav1.ObjectMeta{Name: records.RecordName(spec), Namespace: ns}, Spec: spec,
		Status: v1alpha1.JoinRecordStatus{Count: 3, First: now, Last: now, Message: "index 4: \x1b[31mexpected 00"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	client := env.Client(t, apiservertest.AdminUser)

	var out bytes.Buffer
	if err := runStatusRecords(ctx, &out, client, rc, nil, ns, "", 0, outputText); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	for _, want := range []string{"MACHINES (kubectl get machines): 1 admitted, 0 locked, 0 removed", "MEASUREMENT_MISMATCH", `index 4: \x1b[31mexpected 00`} {
		if !strings.Contains(text, want) {
			t.Errorf("berth status lacks %q:\n%s", want, text)
		}
	}
	if strings.Contains(text, "\x1b") {
		t.Error("berth status printed a peer's escape sequence raw")
	}

	out.Reset()
	if err := runStatusRecords(ctx, &out, client, rc, nil, ns, "w1", 0, outputText); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Node w1: machine 7e7e7e7e7e7e7e7e (worker), Admitted", "last join", "evidence sha256:abababababababab (tpm)", " 4  aabb", "15  ccdd",
		"join trace, reported", "metadata      succeeded  120ms", "ticket        succeeded  2.5s", `attempt 3\x1b[2J`, "kubeadm-join  succeeded  41s",
		"node-ready    failed     5m0s", "NODE_NOT_READY", "in all 5m45s", "NODE_NOT_READY: kubeadm join succeeded, but the Node did not report Ready"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("berth status w1 lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "\x1b") {
		t.Error("berth status w1 printed a node's escape sequence raw")
	}
	t.Logf("berth status w1:\n%s", out.String())
	out.Reset()
	if err := runStatusRecords(ctx, &out, client, rc, nil, ns, "w2", 0, outputJSON); err != nil {
		t.Fatal(err)
	}
	var r recordsReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Node == nil || len(r.Node.Machines) != 0 || len(r.Node.Refusals) != 1 || r.Node.Refusals[0].Count != 3 {
		t.Errorf("berth status w2 -o json = %+v, want no machine and one refusal record of 3", r.Node)
	}
	// A node the cluster never admitted: what the joinservices saw, and where its own trace is.
	out.Reset()
	if err := runStatusRecords(ctx, &out, client, rc, nil, ns, "w2", 0, outputText); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"No machine joined as node w2: the cluster never admitted it.", "What the joinservices saw of it is below; its own trace is join-trace.json",
		"MEASUREMENT_MISMATCH", "What the reasons mean"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("berth status w2 lacks %q:\n%s", want, out.String())
		}
	}
	t.Logf("berth status w2:\n%s", out.String())
	// By address: the refusals of that peer, whatever node they name.
	out.Reset()
	if err := runStatusRecords(ctx, &out, client, rc, nil, ns, "198.51.100.2", 0, outputText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "MEASUREMENT_MISMATCH") || !strings.Contains(out.String(), "198.51.100.2") {
		t.Errorf("berth status 198.51.100.2 lacks the peer's refusal:\n%s", out.String())
	}
	out.Reset()
	if err := runStatusRecords(ctx, &out, client, rc, nil, ns, "w9", 0, outputText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "No refusal names it") || !strings.Contains(out.String(), "berth status ADDRESS") {
		t.Errorf("berth status w9 does not say where to look:\n%s", out.String())
	}
}
