package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/reasons"
)

func TestStatusPrintsRejectedFirst(t *testing.T) {
	t0 := time.Date(2026, 11, 21, 6, 0, 0, 0, time.UTC)
	es := []joinledger.Entry{
		{Time: t0, Peer: "198.51.100.11", Node: "worker-0", Role: "worker", RPC: "join", Outcome: joinledger.OutcomeAccepted, EvidenceSHA256: strings.Repeat("ab", 32), Replica: "cp-0"},
		{Time: t0.Add(time.Second), Peer: "198.51.100.12", Node: "worker-1", Role: "worker", RPC: "join", Outcome: joinledger.OutcomeRejected,
			Reason: "MEASUREMENT_MISMATCH", Message: "index 4: expected 00.., actual 11..", EvidenceSHA256: strings.Repeat("cd", 32), Replica: "cp-0"},
		{Time: t0.Add(2 * time.Second), Peer: "203.0.113.9", RPC: "join", Outcome: joinledger.OutcomeRejected, Reason: "RATE_LIMITED", Count: 40},
	}
	data, _ := json.Marshal(es)
	client := fake.NewClientset(&corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: "berth-system"},
		Data:       map[string]string{joinledger.DataKey: string(data)},
	})
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, client, "berth-system", 0, outputText); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	t.Log("\n" + s)
	rej, acc := strings.Index(s, "REJECTED"), strings.Index(s, "ACCEPTED")
	rl, mm := strings.Index(s, "RATE_LIMITED"), strings.Index(s, "MEASUREMENT_MISMATCH")
	if rej < 0 || acc < rej || rl < rej || mm < rl || mm > acc || !strings.Contains(s, "42 attempts") || !strings.Contains(s, "41 rejected") ||
		!strings.Contains(s, "index 4") || !strings.Contains(s, "sha256:cdcdcd") {
		t.Fatalf("unexpected status output:\n%s", s)
	}
	// Each reason shown gets its short explanation, once, under the refusals.
	for _, want := range []string{"MEASUREMENT_MISMATCH: " + reasons.Short("MEASUREMENT_MISMATCH"), "RATE_LIMITED: " + reasons.Short("RATE_LIMITED")} {
		if i := strings.Index(s, want); i < 0 || i > acc || strings.Count(s, want) != 1 {
			t.Errorf("status output lacks %q once under the refusals:\n%s", want, s)
		}
	}
}

func TestStatusWithoutLedger(t *testing.T) {
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, fake.NewClientset(), "berth-system", 0, outputText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "No join attempts") {
		t.Fatalf("output %q", out.String())
	}
}

// TestStatusStructured decodes berth status -o json and -o yaml: every documented field, the
// order (newest first), --limit with the omitted counts, and a cluster without a ledger.
func TestStatusStructured(t *testing.T) {
	t0 := time.Date(2026, 11, 21, 6, 0, 0, 0, time.UTC)
	es := []joinledger.Entry{
		{Time: t0, Peer: "198.51.100.11", Node: "w1", Role: "worker", RPC: "join", Outcome: joinledger.OutcomeAccepted, EvidenceSHA256: "ab", Replica: "cp1"},
		{Time: t0.Add(time.Second), Peer: "198.51.100.12", Node: "w2", Role: "worker", RPC: "join", Outcome: joinledger.OutcomeRejected,
			Reason: "MEASUREMENT_MISMATCH", Message: "index 4", EvidenceSHA256: "cd", Replica: "cp1"},
		{Time: t0.Add(2 * time.Second), Peer: "203.0.113.9", RPC: "join", Outcome: joinledger.OutcomeRejected, Reason: "RATE_LIMITED", Count: 40},
	}
	data, _ := json.Marshal(es)
	client := fake.NewClientset(&corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: "berth-system"},
		Data:       map[string]string{joinledger.DataKey: string(data)},
	})
	want := statusReport{
		Namespace: "berth-system", LedgerFound: true, Records: 3, Attempts: 42, RejectedAttempts: 41, AcceptedAttempts: 1,
		Rejected: []ledgerRecord{
			{Time: t0.Add(2 * time.Second), Peer: "203.0.113.9", RPC: "join", Outcome: "rejected", Reason: "RATE_LIMITED", Count: 40},
		},
		OmittedRejected: 1,
		Accepted: []ledgerRecord{
			{Time: t0, Peer: "198.51.100.11", Node: "w1", Role: "worker", RPC: "join", Outcome: "accepted", Count: 1, EvidenceSHA256: "ab", Replica: "cp1"},
		},
		Certificates: certificatesReport{ControlPlanes: []controlPlaneCertificates{}},
		// No control plane reported (the fake cluster runs no keeper): not healthy.
		Encryption: &encryptionReport{Provider: "KMS v2 plugin berth", Resources: []string{"secrets"}, APIServerCheck: "unknown (no REST client)",
			Generations: []uint32{1}, Active: 1, ControlPlanes: []encryptionNode{}},
		Membership: []ledgerRecord{}, RemovedMachines: []removedMachine{},
		// No joinservice reported a snapshot: stale.
		Backups: &backupReport{Stale: true},
	}
	for _, format := range []outputFormat{outputJSON, outputYAML} {
		var out bytes.Buffer
		if err := runStatus(context.Background(), &out, client, "berth-system", 1, format); err != nil {
			t.Fatal(err)
		}
		var got statusReport
		var err error
		if format == outputJSON {
			err = json.Unmarshal(out.Bytes(), &got)
		} else {
			err = yaml.UnmarshalStrict(out.Bytes(), &got)
		}
		if err != nil {
			t.Fatalf("decoding -o %s: %v\n%s", format, err, out.String())
		}
		if !reflect.DeepEqual(want, got) {
			t.Errorf("-o %s:\n got %+v\nwant %+v", format, got, want)
		}
	}
	// The field names are the documented, stable ones.
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, client, "berth-system", 0, outputJSON); err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	if err := json.Unmarshal(out.Bytes(), &raw); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"namespace", "ledgerFound", "records", "attempts", "rejectedAttempts", "acceptedAttempts", "rejected", "accepted", "omittedRejected", "omittedAccepted", "certificates", "encryption"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("berth status -o json lacks %q", k)
		}
	}
	rec := raw["rejected"].([]any)[1].(map[string]any)
	for _, k := range []string{"time", "peer", "node", "role", "rpc", "outcome", "reason", "message", "count", "evidenceSHA256", "replica"} {
		if _, ok := rec[k]; !ok {
			t.Errorf("a ledger record of berth status -o json lacks %q", k)
		}
	}

	out.Reset()
	if err := runStatus(context.Background(), &out, fake.NewClientset(), "berth-system", 0, outputJSON); err != nil {
		t.Fatal(err)
	}
	var empty statusReport
	if err := json.Unmarshal(out.Bytes(), &empty); err != nil || empty.LedgerFound || empty.Rejected == nil || len(empty.Rejected) != 0 {
		t.Fatalf("no ledger as JSON: %v %+v\n%s", err, empty, out.String())
	}
}

// TestStatusEscapesPeerText: what a node claimed reaches the terminal escaped.
func TestStatusEscapesPeerText(t *testing.T) {
	es := []joinledger.Entry{{Time: time.Unix(0, 0), Peer: "198.51.100.12", Role: "worker\x1b]0;owned\x07", Outcome: joinledger.OutcomeRejected,
		Reason: "BAD\tROLE", Message: "a\u009bb"}}
	data, _ := json.Marshal(es)
	client := fake.NewClientset(&corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: "berth-system"},
		Data:       map[string]string{joinledger.DataKey: string(data)},
	})
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, client, "berth-system", 0, outputText); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	if strings.ContainsAny(s, "\x1b\x07\u009b") || !strings.Contains(s, `worker\x1b]0;owned\a`) || !strings.Contains(s, `BAD\tROLE`) || !strings.Contains(s, `a\u009bb`) {
		t.Fatalf("peer text not escaped:\n%q", s)
	}
	if got := printable("plain text, ünïcode"); got != "plain text, ünïcode" {
		t.Fatalf("printable changed printable text: %q", got)
	}
	if got := printable("a\xffb"); got != `a\xffb` {
		t.Fatalf("printable(invalid UTF-8) = %q", got)
	}
}
