package noderemove

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/internal/machines"
)

const ns = "berth-system"

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

// controlledBy makes a ReplicaSet the pod's controller.
func controlledBy(p *corev1.Pod) {
	yes := true
	p.OwnerReferences = []metav1.OwnerReference{{Kind: "ReplicaSet", Name: "app", APIVersion: "apps/v1", UID: "rs", Controller: &yes}}
}

// evictFunc answers the eviction of pod name in namespace ns; handled false passes it on.
type evictFunc func(c *fake.Clientset, ns, name string) (handled bool, err error)

// deleteOnEvict deletes the pod, as the API server does when no disruption budget objects.
func deleteOnEvict(c *fake.Clientset, ns, name string) (bool, error) {
	return true, c.Tracker().Delete(schema.GroupVersionResource{Version: "v1", Resource: "pods"}, ns, name)
}

// cluster is a fake cluster with the machine record ms and the objects given, whose discovery
// serves policy/v1 evictions as an API server does; evict answers every eviction.
func cluster(t *testing.T, evict evictFunc, ms []machines.Machine, objs ...runtime.Object) *fake.Clientset {
	t.Helper()
	data, err := machines.Encode(ms)
	if err != nil {
		t.Fatal(err)
	}
	objs = append(objs, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: machines.ConfigMapName, Namespace: ns}, Data: map[string]string{machines.DataKey: data}})
	c := fake.NewClientset(objs...)
	c.Resources = []*metav1.APIResourceList{{GroupVersion: "v1", APIResources: []metav1.APIResource{
		{Name: "pods", Kind: "Pod", Namespaced: true},
		{Name: "pods/eviction", Kind: "Eviction", Group: "policy", Version: "v1", Namespaced: true},
	}}}
	c.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" {
			return false, nil, nil
		}
		handled, err := evict(c, a.GetNamespace(), a.(k8stesting.CreateAction).GetObject().(metav1.Object).GetName())
		return handled, nil, err
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
			_, err := machines.Update(ctx, c, ns, func(ms []machines.Machine) ([]machines.Machine, error) {
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
	ms, err := machines.Read(context.Background(), c, ns)
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

func ledgerOf(t *testing.T, c *fake.Clientset) []joinledger.Entry {
	t.Helper()
	es, err := joinledger.Read(context.Background(), c, ns)
	if err != nil && !errors.Is(err, joinledger.ErrNoLedger) {
		t.Fatal(err)
	}
	return es
}

func podExists(t *testing.T, c *fake.Clientset, name string) bool {
	t.Helper()
	_, err := c.CoreV1().Pods("default").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Fatal(err)
	}
	return err == nil
}

// TestRemoveWorker: the drain cordons the node and evicts its pods, controlled or not and with
// emptyDir data, but not its DaemonSet or static pods, nor pods already terminating; the machine is
// revoked (and its node listed for the API server's revocation policy), the Node deleted with every
// pod still bound to it, and the removal in the ledger.
func TestRemoveWorker(t *testing.T) {
	now := metav1.Now()
	c := cluster(t, deleteOnEvict, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker}},
		node("w1", true),
		pod("app", "w1", controlledBy),
		pod("bare", "w1", nil),
		pod("scratch", "w1", func(p *corev1.Pod) {
			controlledBy(p)
			p.Spec.Volumes = []corev1.Volume{{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
		}),
		pod("flannel", "w1", func(p *corev1.Pod) {
			p.OwnerReferences = []metav1.OwnerReference{{Kind: "DaemonSet", Name: "flannel", APIVersion: "apps/v1", UID: "x"}}
		}),
		pod("static", "w1", func(p *corev1.Pod) { p.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: "x"} }),
		pod("leaving", "w1", func(p *corev1.Pod) { p.DeletionTimestamp = &now; p.Finalizers = []string{"x"} }),
		pod("elsewhere", "w2", nil))
	var progress bytes.Buffer
	r, err := Remove(context.Background(), c, "w1", Options{Namespace: ns, Drain: true, Progress: &progress})
	if err != nil {
		t.Fatalf("remove: %v\n%s", err, progress.String())
	}
	t.Log(progress.String())
	// The drain evicted 3 pods (progress, below); the 3 it spared went with the Node.
	for name, want := range map[string]bool{"app": false, "bare": false, "scratch": false, "flannel": false, "static": false, "leaving": false, "elsewhere": true} {
		if exists := podExists(t, c, name); exists != want {
			t.Errorf("pod %s exists = %v after the removal, want %v", name, exists, want)
		}
	}
	if r.PodsDeleted != 3 {
		t.Errorf("removal deleted %d bound pods, want 3 (flannel, static, leaving)", r.PodsDeleted)
	}
	cm, err := c.CoreV1().ConfigMaps(ns).Get(context.Background(), machines.ConfigMapName, metav1.GetOptions{})
	if err != nil || cm.Data[machines.RevokedNodesKey] != "w1" {
		t.Errorf("record's %s = %q (%v), want w1", machines.RevokedNodesKey, cm.Data[machines.RevokedNodesKey], err)
	}
	if _, err := c.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("Node w1 after remove: %v, want it deleted", err)
	}
	if r.Node != "w1" || r.Role != machines.RoleWorker || r.Identity != idW1 || !r.Drained || !r.NodeDeleted || r.Etcd != "" || r.RevokedAt.IsZero() {
		t.Errorf("result %+v", r)
	}
	ms := record(t, c)
	if !ms[0].Revoked() || ms[0].Removal.Etcd != "" {
		t.Fatalf("machine after remove: %+v", ms[0])
	}
	es := ledgerOf(t, c)
	if len(es) != 1 || es[0].RPC != joinledger.RPCRemove || es[0].Node != "w1" || es[0].Identity != idW1 || es[0].Peer != LedgerPeer ||
		es[0].Message != r.Message() || !strings.Contains(es[0].Message, "pods evicted") {
		t.Fatalf("ledger %+v", es)
	}
	for _, want := range []string{"cordoned w1", "evicted 3 pods from w1", "revoked machine aa1111111111", "deleted 3 pods bound to w1"} {
		if !strings.Contains(progress.String(), want) {
			t.Errorf("progress %q lacks %q", progress.String(), want)
		}
	}
	if _, err := Remove(context.Background(), c, "w9", Options{Namespace: ns}); !errors.Is(err, ErrNotAdmitted) {
		t.Errorf("remove of a node nobody joined as = %v, want ErrNotAdmitted", err)
	}
}

// TestDrainCordons: the drain marks the node unschedulable before it evicts.
func TestDrainCordons(t *testing.T) {
	var cordoned atomic.Bool
	c := cluster(t, func(c *fake.Clientset, ns, name string) (bool, error) {
		// The tracker, not the client: a reactor runs under the client's lock.
		o, err := c.Tracker().Get(schema.GroupVersionResource{Version: "v1", Resource: "nodes"}, "", "w1")
		if err != nil {
			return true, err
		}
		cordoned.Store(o.(*corev1.Node).Spec.Unschedulable)
		return deleteOnEvict(c, ns, name)
	}, nil, node("w1", true), pod("app", "w1", controlledBy))
	n, _ := c.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{})
	if err := drainNode(context.Background(), c, n, func(string, ...any) {}); err != nil {
		t.Fatal(err)
	}
	if !cordoned.Load() {
		t.Fatal("the pod was evicted from a node that was not cordoned")
	}
}

// TestDrainRespectsDisruptionBudget: an eviction a disruption budget refuses (429) is tried again
// until the budget allows it, on a Ready node (kubectl's drain) and on one that is not Ready.
func TestDrainRespectsDisruptionBudget(t *testing.T) {
	for _, ready := range []bool{true, false} {
		t.Run(map[bool]string{true: "ready", false: "not ready"}[ready], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var refusals atomic.Int32
				c := cluster(t, func(c *fake.Clientset, ns, name string) (bool, error) {
					if refusals.Add(1) <= 2 {
						return true, apierrors.NewTooManyRequests("Cannot evict pod as it would violate the pod's disruption budget.", 0)
					}
					return deleteOnEvict(c, ns, name)
				}, nil, node("w1", ready), pod("app", "w1", controlledBy))
				n, _ := c.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{})
				if err := drainNode(context.Background(), c, n, func(string, ...any) {}); err != nil {
					t.Fatal(err)
				}
				if refusals.Load() != 3 || podExists(t, c, "app") {
					t.Fatalf("%d eviction requests, pod still there: %v", refusals.Load(), podExists(t, c, "app"))
				}
			})
		})
	}
}

// TestDrainNotReadyDoesNotWait: on a node that is not Ready the evicted pods are not waited for
// (its kubelet cannot stop them); on a Ready node the drain waits until they are gone.
func TestDrainNotReadyDoesNotWait(t *testing.T) {
	// The eviction is accepted, but the pod stays (terminating on a dead kubelet).
	accept := func(*fake.Clientset, string, string) (bool, error) { return true, nil }
	var said []string
	say := func(f string, args ...any) { said = append(said, f) }
	c := cluster(t, accept, nil, node("w1", false), pod("a", "w1", controlledBy), pod("b", "w1", controlledBy))
	n, _ := c.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{})
	if err := drainNode(context.Background(), c, n, say); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(said, "|"), "not Ready: not waiting") {
		t.Fatalf("said %q", said)
	}
	synctest.Test(t, func(t *testing.T) {
		c := cluster(t, accept, nil, node("w1", true), pod("a", "w1", controlledBy))
		n, _ := c.CoreV1().Nodes().Get(context.Background(), "w1", metav1.GetOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := drainNode(ctx, c, n, func(string, ...any) {}); err == nil {
			t.Fatal("the drain of a Ready node returned although its evicted pod is still there")
		}
	})
}

// TestRemoveControlPlane: the removal waits for a joinservice to remove the etcd member, then
// deletes the Node.
func TestRemoveControlPlane(t *testing.T) {
	c := cluster(t, deleteOnEvict, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, node("cp1", false))
	joinservice(t, c, machines.EtcdRemoved, "removed etcd member cp1 (1a2b)")
	r, err := Remove(context.Background(), c, "cp1", Options{Namespace: ns})
	if err != nil {
		t.Fatalf("remove: %v", err)
	}
	if r.Node != "cp1" || r.Role != machines.RoleControlPlane || r.Identity != idCP1 || r.Etcd != machines.EtcdRemoved ||
		r.EtcdMessage != "removed etcd member cp1 (1a2b)" || !r.NodeDeleted || r.RevokedAt.IsZero() {
		t.Fatalf("result %+v", r)
	}
	if ms := record(t, c); !ms[0].Revoked() || ms[0].Removal.Etcd != machines.EtcdRemoved {
		t.Fatalf("machine %+v", ms[0])
	}
}

// TestRemoveRefusedKeepsEverything: when removing the etcd member would break quorum, nothing
// is removed: the revocation is taken back, the Node stays (cordoned after a drain), nothing is
// recorded, and the error is a *RefusedError naming it.
func TestRemoveRefusedKeepsEverything(t *testing.T) {
	c := cluster(t, deleteOnEvict, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, node("cp1", true))
	joinservice(t, c, machines.EtcdRefused, "removing etcd member cp1 leaves 2 voting members of which 1 answer; they need 2 for quorum")
	_, err := Remove(context.Background(), c, "cp1", Options{Namespace: ns, Drain: true})
	var refused *RefusedError
	if !errors.As(err, &refused) || !refused.Cordoned || !strings.Contains(err.Error(), "need 2 for quorum") ||
		!strings.HasSuffix(err.Error(), "the machine is not revoked; the node stays cordoned (kubectl uncordon cp1)") {
		t.Fatalf("remove = %v, want a RefusedError naming the quorum", err)
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

// TestRemoveResumes: when no joinservice acts in time the machine stays revoked and the removal
// pending; running remove again finishes it.
func TestRemoveResumes(t *testing.T) {
	c := cluster(t, deleteOnEvict, []machines.Machine{{Identity: idCP1, Node: "cp1", Role: machines.RoleControlPlane}}, node("cp1", false))
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if _, err := Remove(ctx, c, "cp1", Options{Namespace: ns}); err == nil || !strings.Contains(err.Error(), "run berth node remove again") {
		t.Fatalf("remove without a joinservice = %v", err)
	}
	if ms := record(t, c); !ms[0].Revoked() || ms[0].Removal.Etcd != machines.EtcdPending {
		t.Fatalf("machine after the timeout: %+v", ms[0])
	}
	joinservice(t, c, machines.EtcdAbsent, "etcd has no member for cp1")
	var progress bytes.Buffer
	if _, err := Remove(context.Background(), c, "cp1", Options{Namespace: ns, Progress: &progress}); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if !strings.Contains(progress.String(), "continuing that removal") {
		t.Errorf("progress %q", progress.String())
	}
	if es := ledgerOf(t, c); len(es) != 1 || !strings.Contains(es[0].Message, "etcd member absent; Node deleted") {
		t.Fatalf("ledger %+v", es)
	}
}

// TestReadmit: readmit lifts a removal and records it; a machine that is not removed cannot be.
func TestReadmit(t *testing.T) {
	removed := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	c := cluster(t, deleteOnEvict, []machines.Machine{{Identity: idW1, Node: "w1", Role: machines.RoleWorker, Removal: &machines.Removal{Time: removed}}})
	r, err := Readmit(context.Background(), c, "w1", Options{Namespace: ns})
	if err != nil {
		t.Fatal(err)
	}
	if r.Node != "w1" || r.Identity != idW1 || !r.RemovedAt.Equal(removed) || !strings.Contains(r.Message, "re-admitted (removed 2026-01-02T03:04:05Z)") {
		t.Fatalf("result %+v", r)
	}
	if ms := record(t, c); ms[0].Removal != nil {
		t.Fatalf("machine after readmit: %+v", ms[0])
	}
	if es := ledgerOf(t, c); len(es) != 1 || es[0].RPC != joinledger.RPCReadmit || es[0].Identity != idW1 || es[0].Message != r.Message {
		t.Fatalf("ledger %+v", es)
	}
	if _, err := Readmit(context.Background(), c, "w1", Options{Namespace: ns}); !errors.Is(err, ErrNotAdmitted) {
		t.Fatalf("second readmit = %v, want ErrNotAdmitted", err)
	}
}
