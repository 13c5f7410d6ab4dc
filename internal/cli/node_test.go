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
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
)

var (
	idW1  = "aa" + strings.Repeat("1", 62)
	idCP1 = "bb" + strings.Repeat("2", 62)
)

func node(name string, ready bool) *corev1.Node {
	status := corev1.ConditionTrue
	if !ready {
		status = corev1.ConditionUnknown
	}
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name},
		Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status}}}}
}

func pod(name, nodeName string, mutate func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: "uid-" + "name"}, Spec: corev1.PodSpec{NodeName: nodeName}}
	if mutate != nil {
		mutate(p)
	}
	return p
}

// nodeCluster is a fake cluster with the machine record ms and the objects given; an eviction
// deletes its pod, as the API server does when no disruption budget objects.
func nodeCluster(t *testing.T, ms []machines.Machine, objs ...runtime.Object) *fake.Clientset {
	t.Helper()
	data, err := machines.Encode(ms)
	if err != nil {
		t.Fatal(err)
	}
	objs = append(objs, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: machines.ConfigMapName, Namespace: "berth-system"}, Data: map[string]string{machines.DataKey: data}})
	c := fake.NewClientset(objs...)
	c.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" {
			return false, nil, nil
		}
		name := a.(k8stesting.CreateAction).GetObject().(metav1.Object).GetName()
		return true, nil, c.Tracker().Delete(a.GetResource(), a.GetNamespace(), name)
	})
	return c
}

// joinservice stands in for a joinservice replica: it decides the first pending etcd removal with
// state and message.
func joinservice(t *testing.T, c *fake.Clientset, state machines.EtcdState, msg string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		_ = wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			decided := false
			_, err := machines.Update(ctx, c, "berth-system", func(ms []machines.Machine) ([]machines.Machine, error) {
				for i := range ms {
					if r := ms[i].Removal; r != nil && r.Etcd == machines.EtcdPending {
						r.Etcd, r.EtcdMessage, decided = state, msg, true
						return ms, nil
					}
				}
				return nil, machines.ErrUnchanged
			})
			return err == nil && decided, nil
		})
	}()
}

func record(t *testing.T, c *fake.Clientset) []machines.Machine {
	t.Helper()
	ms, err := machines.Read(context.Background(), c, "berth-system")
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

func ledgerOf(t *testing.T, c *fake.Clientset) []joinledger.Entry {
	t.Helper()
	es, err := joinledger.Read(context.Background(), c, "berth-system")
	if err != nil && !errors.Is(err, joinledger.ErrNoLedger) {
		t.Fatal(err)
	}
	return es
}

func removeFlags(drain bool) nodeRemoveFlags {
	return nodeRemoveFlags{namespace: "berth-system", drain: drain, output: outputText, timeout: time.Minute}
}

// TestNodeRemoveWorker: with --drain the node is cordoned and its own pods evicted (not its
// DaemonSet or static pods), its machine revoked, the Node deleted, and the removal in the ledger.
func TestNodeRemoveWorker(t *testing.T) {
	c := nodeCluster(t, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker}},
		node("w1", true),
		pod("app", "w1", nil),
		pod("flannel", "w1", func(p *corev1.Pod) {
			p.OwnerReferences = []metav1.OwnerReference{{Kind: "DaemonSet", Name: "flannel", APIVersion: "apps/v1", UID: "x"}}
		}),
		pod("static", "w1", func(p *corev1.Pod) { p.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: "x"} }),
		pod("elsewhere", "w2", nil))
	var out, errOut bytes.Buffer
	if err := runNodeRemove(context.Background(), &out, &errOut, c, "w1", removeFlags(true)); err != nil {
		t.Fatalf("remove: %v\n%s", err, errOut.String())
	}
	t.Log(out.String(), errOut.String())
	for name, want := range map[string]bool{"app": false, "flannel": true, "static": true, "elsewhere": true} {
		_, err := c.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
		if exists := !apierrors.IsNotFound(err); exists != want {
			t.Errorf("pod %s exists = %v after the drain, want %v", name, exists, want)
		}
	}
	if _, err := c.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("Node w1 after remove: %v, want it deleted", err)
	}
	ms := record(t, c)
	if !ms[0].Revoked() || ms[0].Removal.Etcd != "" {
		t.Fatalf("machine after remove: %+v", ms[0])
	}
	es := ledgerOf(t, c)
	if len(es) != 1 || es[0].RPC != joinledger.RPCRemove || es[0].Node != "w1" || es[0].Identity != idW1 || !strings.Contains(es[0].Message, "pods evicted") {
		t.Fatalf("ledger %+v", es)
	}
	if !strings.Contains(out.String(), "removed worker w1") || !strings.Contains(errOut.String(), "cordoned w1") {
		t.Errorf("output %q / %q", out.String(), errOut.String())
	}
	// A second remove finds nothing left to remove of it.
	if err := runNodeRemove(context.Background(), &out, &errOut, c, "w9", removeFlags(false)); !errors.Is(err, errNotAdmitted) {
		t.Errorf("remove of a node nobody joined as = %v, want errNotAdmitted", err)
	}
}

// TestNodeRemoveControlPlane: the removal waits for a joinservice to remove the etcd member, then
// deletes the Node; -o json reports it.
func TestNodeRemoveControlPlane(t *testing.T) {
	c := nodeCluster(t, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, node("cp1", false))
	joinservice(t, c, machines.EtcdRemoved, "removed etcd member cp1 (1a2b)")
	f := removeFlags(false)
	f.output = outputJSON
	var out, errOut bytes.Buffer
	if err := runNodeRemove(context.Background(), &out, &errOut, c, "cp1", f); err != nil {
		t.Fatalf("remove: %v\n%s", err, errOut.String())
	}
	var r removeReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.Node != "cp1" || r.Role != machines.RoleControlPlane || r.Identity != idCP1 || r.Etcd != "removed" || !r.NodeDeleted || r.RevokedAt.IsZero() {
		t.Fatalf("report %+v", r)
	}
	if ms := record(t, c); !ms[0].Revoked() || ms[0].Removal.Etcd != machines.EtcdRemoved {
		t.Fatalf("machine %+v", ms[0])
	}
}

// TestNodeRemoveRefusedKeepsEverything: when removing the etcd member would break quorum, nothing
// is removed: the revocation is taken back, the Node stays, nothing is recorded, exit code 3.
func TestNodeRemoveRefusedKeepsEverything(t *testing.T) {
	c := nodeCluster(t, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, node("cp1", true))
	joinservice(t, c, machines.EtcdRefused, "removing etcd member cp1 leaves 2 voting members of which 1 answer; they need 2 for quorum")
	var out, errOut bytes.Buffer
	err := runNodeRemove(context.Background(), &out, &errOut, c, "cp1", removeFlags(false))
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != exitRejected || !strings.Contains(err.Error(), "need 2 for quorum") {
		t.Fatalf("remove = %v, want exit code %d naming the quorum", err, exitRejected)
	}
	if ms := record(t, c); ms[0].Removal != nil {
		t.Fatalf("machine after a refused removal: %+v", ms[0])
	}
	if _, err := c.CoreV1().Nodes().Get(context.Background(), "cp1", metav1.GetOptions{}); err != nil {
		t.Fatalf("Node cp1 after a refused removal: %v", err)
	}
	if es := ledgerOf(t, c); len(es) != 0 {
		t.Fatalf("ledger after a refused removal: %+v", es)
	}
}

// TestNodeRemoveResumes: when no joinservice acts in time the machine stays revoked and the removal
// pending; running remove again finishes it.
func TestNodeRemoveResumes(t *testing.T) {
	c := nodeCluster(t, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, node("cp1", false))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var out, errOut bytes.Buffer
	if err := runNodeRemove(ctx, &out, &errOut, c, "cp1", removeFlags(false)); err == nil || !strings.Contains(err.Error(), "run berth node remove again") {
		t.Fatalf("remove without a joinservice = %v", err)
	}
	if ms := record(t, c); !ms[0].Revoked() || ms[0].Removal.Etcd != machines.EtcdPending {
		t.Fatalf("machine after the timeout: %+v", ms[0])
	}
	joinservice(t, c, machines.EtcdAbsent, "etcd has no member for cp1")
	if err := runNodeRemove(context.Background(), &out, &errOut, c, "cp1", removeFlags(false)); err != nil {
		t.Fatalf("second remove: %v\n%s", err, errOut.String())
	}
	if es := ledgerOf(t, c); len(es) != 1 || !strings.Contains(es[0].Message, "etcd member absent; Node deleted") {
		t.Fatalf("ledger %+v", es)
	}
}

// TestNodeReadmit: readmit lifts a removal and records it; a machine that is not removed cannot be.
func TestNodeReadmit(t *testing.T) {
	c := nodeCluster(t, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker, Removal: &machines.Removal{Time: time.Now().UTC()}}})
	f := nodeReadmitFlags{namespace: "berth-system", output: outputText}
	var out bytes.Buffer
	if err := runNodeReadmit(context.Background(), &out, c, "w1", f); err != nil {
		t.Fatal(err)
	}
	if ms := record(t, c); ms[0].Removal != nil {
		t.Fatalf("machine after readmit: %+v", ms[0])
	}
	if es := ledgerOf(t, c); len(es) != 1 || es[0].RPC != joinledger.RPCReadmit || es[0].Identity != idW1 {
		t.Fatalf("ledger %+v", es)
	}
	if err := runNodeReadmit(context.Background(), &out, c, "w1", f); !errors.Is(err, errNotAdmitted) {
		t.Fatalf("second readmit = %v, want errNotAdmitted", err)
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
