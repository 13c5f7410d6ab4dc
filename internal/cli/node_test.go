package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/machines"
	"github.com/berth-k8s/berth/internal/noderemove"
)

// The procedure of node remove and readmit is tested in internal/noderemove; these tests check
// the command's face: its output, its report and its exit codes.

var (
	idW1  = "aa" + strings.Repeat("1", 62)
	idCP1 = "bb" + strings.Repeat("2", 62)
)

// machineCluster is a fake cluster with the machine record ms and Node objects of the names given.
func machineCluster(t *testing.T, ms []machines.Machine, nodes ...string) *fake.Clientset {
	t.Helper()
	data, err := machines.Encode(ms)
	if err != nil {
		t.Fatal(err)
	}
	c := fake.NewClientset(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: machines.ConfigMapName, Namespace: "berth-system"}, Data: map[string]string{machines.DataKey: data}})
	for _, n := range nodes {
		if _, err := c.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

func removeFlags(output outputFormat) nodeRemoveFlags {
	return nodeRemoveFlags{namespace: "berth-system", output: output, timeout: time.Minute}
}

// TestNodeRemoveOutput: the text line on stdout, progress on stderr, and the -o json report with
// its stable field names.
func TestNodeRemoveOutput(t *testing.T) {
	c := machineCluster(t, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker}}, "w1")
	var out, errOut bytes.Buffer
	if err := runNodeRemove(context.Background(), &out, &errOut, c, nil, "w1", removeFlags(outputText)); err != nil {
		t.Fatalf("remove: %v\n%s", err, errOut.String())
	}
	if !strings.HasPrefix(out.String(), "removed worker w1 in ") || !strings.HasSuffix(out.String(), "s: machine aa11111111111111 revoked; Node deleted\n") {
		t.Errorf("stdout %q", out.String())
	}
	if !strings.Contains(errOut.String(), "revoked machine aa11111111111111 (worker w1)") {
		t.Errorf("stderr %q", errOut.String())
	}

	// A control plane whose etcd member a joinservice removed already: the removal resumes.
	c = machineCluster(t, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane,
		Removal: &machines.Removal{Time: time.Now().UTC(), Etcd: machines.EtcdRemoved, EtcdMessage: "removed etcd member cp1"}}}, "cp1")
	out.Reset()
	if err := runNodeRemove(context.Background(), &out, &errOut, c, nil, "cp1", removeFlags(outputJSON)); err != nil {
		t.Fatalf("remove: %v\n%s", err, errOut.String())
	}
	var fields map[string]any
	if err := json.Unmarshal(out.Bytes(), &fields); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"node", "role", "identity", "revokedAt", "drained", "etcd", "etcdMessage", "nodeDeleted", "seconds"} {
		if _, ok := fields[k]; !ok {
			t.Errorf("report %s lacks %q", out.String(), k)
		}
	}
	var r removeReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Node != "cp1" || r.Role != machines.RoleControlPlane || r.Identity != idCP1 || r.Etcd != "removed" || r.EtcdMessage != "removed etcd member cp1" || !r.NodeDeleted || r.RevokedAt.IsZero() {
		t.Fatalf("report %+v", r)
	}
}

// TestNodeRemoveExitCodes: a refused etcd member removal is exit code 3 with the joinservice's
// reason; a node nobody joined as is an error of its own.
func TestNodeRemoveExitCodes(t *testing.T) {
	c := machineCluster(t, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, "cp1")
	// A joinservice replica stand-in refuses the pending etcd member removal.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		_ = wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			decided := false
			_, err := machines.Update(ctx, c, "berth-system", func(ms []machines.Machine) ([]machines.Machine, error) {
				if r := ms[0].Removal; r != nil && r.Etcd == machines.EtcdPending {
					r.Etcd, r.EtcdMessage, decided = machines.EtcdRefused, "they need 2 for quorum", true
					return ms, nil
				}
				return nil, machines.ErrUnchanged
			})
			return err == nil && decided, nil
		})
	}()
	var out, errOut bytes.Buffer
	err := runNodeRemove(context.Background(), &out, &errOut, c, nil, "cp1", removeFlags(outputText))
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != exitRejected || err.Error() != "not removing cp1: they need 2 for quorum; the machine is not revoked" {
		t.Fatalf("remove = %v, want exit code %d naming the quorum", err, exitRejected)
	}
	if out.Len() != 0 {
		t.Errorf("stdout after a refusal: %q", out.String())
	}
	err = runNodeRemove(context.Background(), &out, &errOut, c, nil, "w9", removeFlags(outputText))
	if !errors.Is(err, noderemove.ErrNotAdmitted) || errors.As(err, &ee) {
		t.Errorf("remove of a node nobody joined as = %v, want ErrNotAdmitted", err)
	}
}

// TestNodeReadmitOutput: the text line and the -o json report.
func TestNodeReadmitOutput(t *testing.T) {
	removed := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	c := machineCluster(t, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker, Removal: &machines.Removal{Time: removed}}})
	var out bytes.Buffer
	if err := runNodeReadmit(context.Background(), &out, c, nil, "w1", nodeReadmitFlags{namespace: "berth-system", output: outputText}); err != nil {
		t.Fatal(err)
	}
	if want := "w1: machine aa11111111111111 re-admitted (removed 2026-01-02T03:04:05Z); it joins on its next attempt\n"; out.String() != want {
		t.Errorf("stdout %q, want %q", out.String(), want)
	}
	err := runNodeReadmit(context.Background(), &out, c, nil, "w1", nodeReadmitFlags{namespace: "berth-system", output: outputJSON})
	if !errors.Is(err, noderemove.ErrNotAdmitted) {
		t.Fatalf("second readmit = %v, want ErrNotAdmitted", err)
	}
	c = machineCluster(t, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker, Removal: &machines.Removal{Time: removed}}})
	out.Reset()
	if err := runNodeReadmit(context.Background(), &out, c, nil, "w1", nodeReadmitFlags{namespace: "berth-system", output: outputJSON}); err != nil {
		t.Fatal(err)
	}
	var r readmitReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil || r.Node != "w1" || r.Role != machines.RoleWorker || r.Identity != idW1 || !r.RemovedAt.Equal(removed) {
		t.Fatalf("report %s (%v)", out.String(), err)
	}
}

func TestNodeCommandHelpAndUsage(t *testing.T) {
	for _, args := range [][]string{{"node", "remove", "--help"}, {"node", "readmit", "--help"}} {
		var out, errOut bytes.Buffer
		if code := Execute(context.Background(), args, &out, &errOut); code != exitOK || !strings.Contains(out.String(), "Examples:") {
			t.Errorf("%v: code %d, output %q", args, code, out.String())
		}
	}
	for _, args := range [][]string{{"node", "remove"}, {"node", "remove", "a", "b"}, {"node", "readmit"}, {"node", "remove", "w1", "-o", "xml"}} {
		var out, errOut bytes.Buffer
		if code := Execute(context.Background(), args, &out, &errOut); code != exitUsage {
			t.Errorf("%v: code %d, want usage error", args, code)
		}
	}
}
