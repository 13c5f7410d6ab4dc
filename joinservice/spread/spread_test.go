package spread

import (
	"context"
	"testing"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

// testDeployment is the webhook's Deployment: the joinservice's Role lets it read that one only.
const testDeployment = webhookconfig.Name

var labels = map[string]string{"app.kubernetes.io/name": testDeployment}

// cluster is a real API server with berth-system installed, as the admin and as the joinservice.
type cluster struct {
	t     *testing.T
	admin kubernetes.Interface
	js    kubernetes.Interface
	ctx   context.Context
}

func newCluster(t *testing.T) *cluster {
	t.Helper()
	env := apiservertest.Shared(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, admin: env.Client(t, apiservertest.AdminUser), js: env.Client(t, apiservertest.JoinServiceUser), ctx: ctx}
	c.cleanup()
	t.Cleanup(c.cleanup)
	return c
}

// cleanup removes what a test created (the API server is shared), pods at once.
func (c *cluster) cleanup() {
	zero := int64(0)
	ns := joinconfig.Namespace
	_ = c.admin.AppsV1().Deployments(ns).Delete(c.ctx, testDeployment, metav1.DeleteOptions{})
	_ = c.admin.PolicyV1().PodDisruptionBudgets(ns).Delete(c.ctx, testDeployment, metav1.DeleteOptions{})
	_ = c.admin.CoreV1().Pods(ns).DeleteCollection(c.ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + testDeployment})
	_ = c.admin.CoreV1().Nodes().DeleteCollection(c.ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "spread-test=true"})
}

// node registers a node, Ready or not, with taints.
func (c *cluster) node(name string, ready bool, taints ...corev1.Taint) {
	c.t.Helper()
	n, err := c.admin.CoreV1().Nodes().Create(c.ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"spread-test": "true"}},
		Spec: corev1.NodeSpec{Taints: taints}}, metav1.CreateOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status, LastHeartbeatTime: metav1.Now(), LastTransitionTime: metav1.Now()}}
	if n, err = c.admin.CoreV1().Nodes().UpdateStatus(c.ctx, n, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
	// The API server taints a new node not-ready; the node lifecycle controller (not running here)
	// would lift it once Ready.
	if ready {
		n.Spec.Taints = taints
	} else {
		n.Spec.Taints = append(taints, corev1.Taint{Key: corev1.TaintNodeNotReady, Effect: corev1.TaintEffectNoSchedule})
	}
	if _, err := c.admin.CoreV1().Nodes().Update(c.ctx, n, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

// deployment creates the webhook's Deployment with replicas, tolerating the control-plane taint,
// its status stable or not (no controller runs here), and its disruption budget's status.
func (c *cluster) deployment(replicas int32, stableStatus bool, disruptionsAllowed int32) {
	c.t.Helper()
	ns := joinconfig.Namespace
	d, err := c.admin.AppsV1().Deployments(ns).Create(c.ctx, &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: testDeployment},
		Spec: appsv1.DeploymentSpec{Replicas: &replicas, Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: corev1.PodSpec{
				Tolerations: []corev1.Toleration{{Key: "node-role.kubernetes.io/control-plane", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}},
				Containers:  []corev1.Container{{Name: "webhook", Image: "berth/joinservice:test", SecurityContext: restricted()}},
			}}},
	}, metav1.CreateOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	if stableStatus {
		d.Status = appsv1.DeploymentStatus{ObservedGeneration: d.Generation, Replicas: replicas, UpdatedReplicas: replicas, ReadyReplicas: replicas, AvailableReplicas: replicas}
		if _, err := c.admin.AppsV1().Deployments(ns).UpdateStatus(c.ctx, d, metav1.UpdateOptions{}); err != nil {
			c.t.Fatal(err)
		}
	}
	one := intstr.FromInt32(1)
	pdb, err := c.admin.PolicyV1().PodDisruptionBudgets(ns).Create(c.ctx, &policyv1.PodDisruptionBudget{ObjectMeta: metav1.ObjectMeta{Name: testDeployment},
		Spec: policyv1.PodDisruptionBudgetSpec{MaxUnavailable: &one, Selector: &metav1.LabelSelector{MatchLabels: labels}}}, metav1.CreateOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	// No disruption controller runs here: the budget's status is set as it would compute it.
	pdb.Status = policyv1.PodDisruptionBudgetStatus{ObservedGeneration: pdb.Generation, DisruptionsAllowed: disruptionsAllowed,
		CurrentHealthy: replicas, DesiredHealthy: replicas - 1, ExpectedPods: replicas}
	if _, err := c.admin.PolicyV1().PodDisruptionBudgets(ns).UpdateStatus(c.ctx, pdb, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

// pod runs a ready replica on node.
func (c *cluster) pod(name, node string) {
	c.t.Helper()
	p, err := c.admin.CoreV1().Pods(joinconfig.Namespace).Create(c.ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: joinconfig.ServiceAccountName, AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{Name: "webhook", Image: "berth/joinservice:test", SecurityContext: restricted()}}}}, metav1.CreateOptions{})
	if err != nil {
		c.t.Fatal(err)
	}
	p.Status.Phase = corev1.PodRunning
	p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	if _, err := c.admin.CoreV1().Pods(joinconfig.Namespace).UpdateStatus(c.ctx, p, metav1.UpdateOptions{}); err != nil {
		c.t.Fatal(err)
	}
}

func (c *cluster) keeper() *Keeper {
	return New(c.js, joinconfig.Namespace, testDeployment, zaptest.NewLogger(c.t))
}

func (c *cluster) evicted(name string) bool {
	p, err := c.admin.CoreV1().Pods(joinconfig.Namespace).Get(c.ctx, name, metav1.GetOptions{})
	return err != nil || p.DeletionTimestamp != nil
}

// TestSpreadEvictsTheNewestCrowdedReplica: as the joinservice, with its RBAC, the keeper evicts the
// newer of two replicas on one node (created in the same second here: the later name) when another Ready node could run it, and does nothing more
// once that one is going.
func TestSpreadEvictsTheNewestCrowdedReplica(t *testing.T) {
	c := newCluster(t)
	c.node("spread-cp1", true, corev1.Taint{Key: "node-role.kubernetes.io/control-plane", Effect: corev1.TaintEffectNoSchedule})
	c.node("spread-w1", true)
	c.deployment(2, true, 1)
	c.pod("wh-1", "spread-cp1")
	c.pod("wh-2", "spread-cp1")
	k := c.keeper()
	got, err := k.Check(c.ctx)
	if err != nil || got != "wh-2" {
		t.Fatalf("Check() = %q, %v; want wh-2 evicted", got, err)
	}
	if !c.evicted("wh-2") || c.evicted("wh-1") {
		t.Fatalf("after the eviction: wh-2 evicted %v, wh-old evicted %v", c.evicted("wh-2"), c.evicted("wh-1"))
	}
	if got, err := k.Check(c.ctx); err != nil || got != "" {
		t.Fatalf("second Check() = %q, %v; want nothing while the evicted pod goes", got, err)
	}
}

// TestSpreadLeavesAloneWhenItCannotHelp: no eviction when the only other node is not Ready,
// cordoned or has a taint the replicas do not tolerate, while the Deployment rolls out, or when the
// disruption budget allows none; nor when the replicas are spread already.
func TestSpreadLeavesAloneWhenItCannotHelp(t *testing.T) {
	for name, tc := range map[string]struct {
		other      func(c *cluster)
		stable     bool
		disruption int32
		spread     bool
	}{
		"other node not ready": {other: func(c *cluster) { c.node("spread-w1", false) }, stable: true, disruption: 1},
		"other node tainted": {other: func(c *cluster) {
			c.node("spread-w1", true, corev1.Taint{Key: "gpu", Effect: corev1.TaintEffectNoSchedule})
		}, stable: true, disruption: 1},
		"rolling out":             {other: func(c *cluster) { c.node("spread-w1", true) }, stable: false, disruption: 1},
		"budget allows none":      {other: func(c *cluster) { c.node("spread-w1", true) }, stable: true, disruption: 0},
		"spread already (2 of 2)": {other: func(c *cluster) { c.node("spread-w1", true); c.node("spread-w2", true) }, stable: true, disruption: 1, spread: true},
	} {
		t.Run(name, func(t *testing.T) {
			c := newCluster(t)
			c.node("spread-cp1", true)
			tc.other(c)
			c.deployment(2, tc.stable, tc.disruption)
			c.pod("wh-a", "spread-cp1")
			second := "spread-cp1"
			if tc.spread {
				second = "spread-w1"
			}
			c.pod("wh-b", second)
			if got, err := c.keeper().Check(c.ctx); err != nil || got != "" || c.evicted("wh-a") || c.evicted("wh-b") {
				t.Fatalf("Check() = %q, %v; want no eviction", got, err)
			}
		})
	}
}

// restricted is a container security context that Pod Security "restricted" admits, as berth-system
// enforces.
func restricted() *corev1.SecurityContext {
	no, yes := false, true
	return &corev1.SecurityContext{AllowPrivilegeEscalation: &no, RunAsNonRoot: &yes,
		Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}}
}
