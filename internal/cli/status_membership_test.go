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
	"github.com/berth-k8s/berth/internal/machines"
)

// membershipCluster is a cluster whose ledger holds joins and membership events and whose machine
// record holds a removed worker, a removed control plane whose etcd member is pending, and a
// re-admitted machine.
func membershipCluster(t *testing.T) *fake.Clientset {
	t.Helper()
	t0 := time.Date(2026, 11, 25, 6, 0, 0, 0, time.UTC)
	es := []joinledger.Entry{
		{Time: t0, Peer: "198.51.100.11", Node: "cp2", Role: "control-plane", RPC: "join", Outcome: joinledger.OutcomeAccepted},
		{Time: t0.Add(time.Second), Peer: "198.51.100.12", Node: "cp3", Role: "control-plane", RPC: "join", Outcome: joinledger.OutcomeRejected, Reason: "CONTROL_PLANE_JOIN_BUSY", Message: "control plane cp2 is joining"},
		{Time: t0.Add(40 * time.Second), Peer: "198.51.100.11", Node: "cp2", Role: "control-plane", RPC: joinledger.RPCControlPlaneJoin, Outcome: joinledger.OutcomeAccepted, Message: "joined 40s after the ticket"},
		{Time: t0.Add(90 * time.Second), Peer: "operator", Node: "w1", Role: "worker", RPC: joinledger.RPCRemove, Outcome: joinledger.OutcomeAccepted, Message: "machine aa revoked"},
		{Time: t0.Add(99 * time.Second), Peer: "198.51.100.13", Node: "w1", Role: "worker", RPC: "rejoin", Outcome: joinledger.OutcomeRejected, Reason: joinledger.ReasonRevoked},
	}
	data, _ := json.Marshal(es)
	ms, _ := machines.Encode([]machines.Machine{
		{Identity: "aa" + strings.Repeat("0", 62), Node: "w1", Role: machines.RoleWorker, Removal: &machines.Removal{Time: t0.Add(90 * time.Second)}},
		{Identity: "bb" + strings.Repeat("0", 62), Node: "cp1", Role: machines.RoleControlPlane, Removal: &machines.Removal{Time: t0.Add(95 * time.Second), Etcd: machines.EtcdPending, EtcdMessage: "etcd has no quorum"}},
		{Identity: "cc", Node: "w2", Role: machines.RoleWorker},
	})
	return fake.NewClientset(
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: joinledger.ConfigMapName, Namespace: "berth-system"}, Data: map[string]string{joinledger.DataKey: string(data)}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: machines.ConfigMapName, Namespace: "berth-system"}, Data: map[string]string{machines.DataKey: ms}},
	)
}

// TestStatusShowsMembership: membership events are their own section, not join attempts; removed
// machines are listed newest first with a pending etcd member's last message; re-admitted ones are not.
func TestStatusShowsMembership(t *testing.T) {
	client := membershipCluster(t)
	var out bytes.Buffer
	if err := runStatus(context.Background(), &out, client, "berth-system", 0, outputText); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	t.Log("\n" + s)
	mem, removed := strings.Index(s, "MEMBERSHIP (2"), strings.Index(s, "REMOVED MACHINES (2")
	if !strings.Contains(s, "3 attempts in the last 3 records") || mem < 0 || removed < mem ||
		strings.Index(s[mem:], "remove") > strings.Index(s[mem:], "control-plane-join") || // newest first
		!strings.Contains(s[removed:], "pending (etcd has no quorum)") || strings.Index(s[removed:], "cp1") > strings.Index(s[removed:], "w1") ||
		strings.Contains(s[removed:], "w2") || !strings.Contains(s, "REVOKED") {
		t.Fatalf("unexpected status output:\n%s", s)
	}

	out.Reset()
	if err := runStatus(context.Background(), &out, client, "berth-system", 1, outputJSON); err != nil {
		t.Fatal(err)
	}
	var r statusReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Records != 3 || len(r.Membership) != 1 || r.Membership[0].RPC != joinledger.RPCRemove || r.OmittedMembership != 1 ||
		len(r.RemovedMachines) != 2 || r.RemovedMachines[0].Node != "cp1" || r.RemovedMachines[0].Etcd != "pending" || r.RemovedMachines[1].Identity != "aa"+strings.Repeat("0", 62) {
		t.Fatalf("-o json: %+v", r)
	}
	var raw map[string]any
	_ = json.Unmarshal(out.Bytes(), &raw)
	for _, k := range []string{"membership", "omittedMembership", "removedMachines"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("berth status -o json lacks %q", k)
		}
	}
	rm := raw["removedMachines"].([]any)[0].(map[string]any)
	for _, k := range []string{"node", "role", "identity", "removed", "etcd", "etcdMessage"} {
		if _, ok := rm[k]; !ok {
			t.Errorf("a removed machine of berth status -o json lacks %q", k)
		}
	}
}
