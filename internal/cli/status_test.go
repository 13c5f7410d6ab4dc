package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/joinledger"
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
	if err := runStatus(context.Background(), &out, client, "berth-system", 0); err != nil {
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
}

func TestStatusWithoutLedger(t *testing.T) {
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, fake.NewClientset(), "berth-system", 0); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "No join attempts") {
		t.Fatalf("output %q", out.String())
	}
}
