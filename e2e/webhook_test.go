//go:build e2e

package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/prereq"
)

const (
	whDenied   = "evil.example/app:1"
	whAllowed  = "berth.local/testapp:v1"
	whMarker   = `image policy rule "default-deny"`
	whHookName = "image-policy.berth-webhook.berth-system.svc"
)

// restrictedPod makes pod meet the Pod Security Standard "restricted" (berth-system enforces it).
func restrictedPod(pod *corev1.Pod) *corev1.Pod {
	yes, no := true, false
	pod.Spec.SecurityContext = &corev1.PodSecurityContext{RunAsNonRoot: &yes,
		SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}}
	for i := range pod.Spec.Containers {
		pod.Spec.Containers[i].SecurityContext = &corev1.SecurityContext{AllowPrivilegeEscalation: &no,
			Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}}
	}
	return pod
}

func whPod(ns, name, image string, finalizers ...string) *corev1.Pod {
	never := false
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Finalizers: finalizers},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: &never,
			Containers:                   []corev1.Container{{Name: "app", Image: image, ImagePullPolicy: corev1.PullNever, Args: []string{"serve"}}},
		},
	}
}

// TestMiniWebhook checks the image-policy webhook on a real mini cluster (1 control plane, 1 worker):
// berth init installed and armed it; a disallowed image is denied naming the rule, an allowed one
// admitted, kube-system never blocked; >= 10 rollout restarts while two clients send >= 5,000
// server-side dry-run pod creates, zero failures; with the Deployment scaled to 0, deleting a
// pod and removing a finalizer from a terminating pod succeed while other creates fail closed, and a
// kube-system DaemonSet pod is re-created; after berth mini restart the webhook enforces again
// with no manual step and the configuration is unchanged; the restarted bootstrapper re-runs
// the installer, which writes nothing.
func TestMiniWebhook(tt *testing.T) {
	t := recordFailures(tt)
	if os.Geteuid() != 0 {
		prereq.Missing(t, "needs root")
	}
	root := repoRoot(t)
	if _, err := os.Stat(filepath.Join(root, "bin", "berth-webhook")); err != nil {
		prereq.Missing(t, "bin/berth-webhook missing: the mini cluster cannot carry the webhook image (make build with the webhook wired)")
	}
	c := &cluster{t: t, root: root, dir: filepath.Join(t.TempDir(), "cluster"), berth: filepath.Join(root, "bin", "berth")}
	kbin := strings.TrimSpace(c.must(30*time.Minute, filepath.Join(root, "scripts", "build-k8s.sh"), "k8s"))
	c.kubectl = filepath.Join(kbin, "kubectl")
	start := time.Now()
	out, err := c.run(30*time.Minute, c.berth, "mini", "up", "--dir", c.dir, "--name", clusterName, "--subnet", subnet,
		"--control-planes", "1", "--workers", "1")
	t.Logf("berth mini up (%.1fs):\n%s", time.Since(start).Seconds(), out)
	defer func() {
		if out, err := c.run(5*time.Minute, c.berth, "mini", "down", "--dir", c.dir); err != nil {
			t.Errorf("berth mini down: %v\n%s", err, out)
		}
	}()
	if err != nil {
		dumpLogs(t, c.dir)
		t.Fatalf("berth mini up: %v", err)
	}
	if _, err := c.run(time.Minute, c.kubectl, "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "get", "validatingwebhookconfiguration", "berth-image-policy"); err != nil {
		prereq.Missing(t, "berth init did not install the webhook (no --webhook-image: bin/berth-webhook was not built)")
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(c.dir, "admin.conf"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = -1, 0
	kube := kubernetes.NewForConfigOrDie(cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	c.kube("-n", "berth-system", "rollout", "status", "deployment/berth-webhook", "--timeout=180s")
	c.kube("create", "namespace", "wh")
	waitSA(t, ctx, kube, "wh")
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}

	// Decisions.
	_, err = kube.CoreV1().Pods("wh").Create(ctx, whPod("wh", "denied", whDenied), dry)
	if err == nil || !strings.Contains(err.Error(), whMarker) {
		t.Fatalf("disallowed image: %v, want a denial naming the rule", err)
	}
	t.Logf("disallowed image denied: %v", err)
	if _, err := kube.CoreV1().Pods("wh").Create(ctx, whPod("wh", "allowed", whAllowed), dry); err != nil {
		t.Fatalf("allowed image: %v", err)
	}
	if _, err := kube.CoreV1().Pods("kube-system").Create(ctx, whPod("kube-system", "any", whDenied), dry); err != nil {
		t.Fatalf("kube-system: %v", err)
	}
	// berth-system is exempt from the webhook but locked down to Berth's own images (its image guard).
	// The pod meets berth-system's Pod Security "restricted", so that the guard is what refuses it.
	if _, err := kube.CoreV1().Pods("berth-system").Create(ctx, restrictedPod(whPod("berth-system", "foreign", whAllowed)), dry); err == nil || !strings.Contains(err.Error(), "berth-system-images") {
		t.Errorf("foreign image in berth-system: %v, want a refusal by policy berth-system-images", err)
	} else {
		t.Logf("foreign image in berth-system refused: %v", err)
	}
	rvBefore := strings.TrimSpace(c.kube("get", "validatingwebhookconfiguration", "berth-image-policy", "-o", "jsonpath={.metadata.resourceVersion}"))

	// Rollout restarts under load, with zero failed requests.
	var total, failed atomic.Int64
	var mu sync.Mutex
	var failures []string
	done := make(chan struct{})
	var wg sync.WaitGroup
	t1 := time.Now()
	for cl := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := kubernetes.NewForConfigOrDie(cfg)
			for n := 0; ; n++ {
				select {
				case <-done:
					if total.Load() >= 5000 {
						return
					}
				case <-ctx.Done():
					return
				default:
				}
				deny := n%2 == 1
				image := whAllowed
				if deny {
					image = whDenied
				}
				_, err := client.CoreV1().Pods("wh").Create(ctx, whPod("wh", fmt.Sprintf("l%d-%d", cl, n), image), dry)
				total.Add(1)
				if (!deny && err != nil) || (deny && (err == nil || !strings.Contains(err.Error(), whMarker))) {
					failed.Add(1)
					mu.Lock()
					if len(failures) < 10 {
						failures = append(failures, fmt.Sprintf("%s deny=%v: %v", time.Since(t1).Round(time.Millisecond), deny, err))
					}
					mu.Unlock()
				}
			}
		}()
	}
	for i := range 10 {
		c.kube("-n", "berth-system", "rollout", "restart", "deployment/berth-webhook")
		c.kube("-n", "berth-system", "rollout", "status", "deployment/berth-webhook", "--timeout=300s")
		t.Logf("rollout restart %d/10 done at %s, %d requests", i+1, time.Since(t1).Round(time.Second), total.Load())
	}
	// Further disturbances under the same load: delete each pod, then scale 2 -> 1 -> 2.
	for range 2 {
		name := strings.TrimSpace(c.kube("-n", "berth-system", "get", "pod", "-l", "app.kubernetes.io/name=berth-webhook",
			"--field-selector=status.phase=Running", "-o", "jsonpath={.items[0].metadata.name}"))
		c.kube("-n", "berth-system", "delete", "pod", name, "--wait=false")
		c.kube("-n", "berth-system", "rollout", "status", "deployment/berth-webhook", "--timeout=300s")
		waitWebhookPods(t, ctx, kube, 2)
	}
	c.kube("-n", "berth-system", "scale", "deployment/berth-webhook", "--replicas=1")
	waitWebhookPods(t, ctx, kube, 1)
	c.kube("-n", "berth-system", "scale", "deployment/berth-webhook", "--replicas=2")
	c.kube("-n", "berth-system", "rollout", "status", "deployment/berth-webhook", "--timeout=300s")
	t.Logf("2 pod deletions and a scale 2 -> 1 -> 2 done at %s, %d requests", time.Since(t1).Round(time.Second), total.Load())
	close(done)
	wg.Wait()
	t.Logf("rollout under load: 10 rollout restarts, 2 pod deletions, scale 2 -> 1 -> 2 in %s; %d dry-run creates by 2 clients, %d failed",
		time.Since(t1).Round(time.Second), total.Load(), failed.Load())
	if failed.Load() != 0 {
		t.Errorf("rollout under load: %d failed requests:\n%s", failed.Load(), strings.Join(failures, "\n"))
	}

	// Every webhook pod gone: deletes and finalizer removals still work, other creates fail closed.
	if _, err := kube.CoreV1().Pods("wh").Create(ctx, whPod("wh", "held", whAllowed, "berth.test/hold"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := kube.CoreV1().Pods("wh").Create(ctx, whPod("wh", "plain", whAllowed), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.kube("-n", "berth-system", "scale", "deployment/berth-webhook", "--replicas=0")
	if err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := kube.CoreV1().Pods("berth-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=berth-webhook"})
		return err == nil && len(list.Items) == 0, nil
	}); err != nil {
		t.Fatalf("webhook pods did not go away: %v", err)
	}
	c.kube("-n", "wh", "delete", "pod", "plain", "--wait=false")
	c.kube("-n", "wh", "delete", "pod", "held", "--wait=false")
	c.kube("-n", "wh", "patch", "pod", "held", "--type=json", `-p=[{"op":"remove","path":"/metadata/finalizers"}]`)
	_, err = kube.CoreV1().Pods("wh").Create(ctx, whPod("wh", "while-down", whAllowed), dry)
	if err == nil || !strings.Contains(err.Error(), "failed calling webhook") {
		t.Errorf("create with no webhook pod: %v, want a fail-closed rejection", err)
	}
	c.kube("-n", "kube-system", "delete", "pod", "-l", "k8s-app=kube-proxy", "--wait=false")
	c.kube("-n", "kube-system", "rollout", "status", "daemonset/kube-proxy", "--timeout=180s")
	c.kube("-n", "berth-system", "scale", "deployment/berth-webhook", "--replicas=2")
	c.kube("-n", "berth-system", "rollout", "status", "deployment/berth-webhook", "--timeout=180s")

	// Power cut of all nodes: the webhook enforces again with no manual step.
	t8 := time.Now()
	out = c.must(15*time.Minute, c.berth, "mini", "restart", "--dir", c.dir)
	t.Logf("berth mini restart:\n%s", out)
	var last error
	if err := wait.PollUntilContextTimeout(ctx, time.Second, 10*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, last = kube.CoreV1().Pods("wh").Create(ctx, whPod("wh", "after-restart", whDenied), dry)
		return last != nil && strings.Contains(last.Error(), whMarker), nil
	}); err != nil {
		t.Fatalf("restart: webhook not enforcing 10 min after the restart: %v", last)
	}
	t.Logf("restart: enforcing again %s after berth mini restart began", time.Since(t8).Round(time.Second))
	if rv := strings.TrimSpace(c.kube("get", "validatingwebhookconfiguration", "berth-image-policy", "-o", "jsonpath={.metadata.resourceVersion}")); rv != rvBefore {
		t.Errorf("configuration resourceVersion %s -> %s across restarts", rvBefore, rv)
	}

	// The check after a restart: the restarted bootstrapper on cp1 re-ran the installer (wait for
	// the webhook, probe every endpoint, prove enforcement) and, the cluster being healthy, wrote
	// nothing.
	blog := filepath.Join(c.dir, "nodes", "cp1", "logs", "bootstrapper.log")
	var after string
	err = wait.PollUntilContextTimeout(ctx, time.Second, 12*time.Minute-time.Since(t8), true, func(context.Context) (bool, error) {
		b, _ := os.ReadFile(blog)
		// Only what the daemon logged since the restart counts.
		after = string(b)
		if i := strings.LastIndex(after, "bootstrapper starting"); i >= 0 {
			after = after[i:]
		}
		if strings.Contains(after, "cluster components checked after the restart") {
			return true, nil
		}
		if strings.Contains(after, "checking the cluster's components after the restart failed") {
			return false, errors.New("the installer's re-run after the restart failed")
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("re-check after restart: no successful installer re-run logged 12 min after the restart (%v):\n%s", err, after)
	}
	if !strings.Contains(after, "enforcing (0 writes in this run)") {
		t.Errorf("re-check after restart: the installer's re-run after the restart wrote something:\n%s", after)
	}
	t.Logf("re-check after restart: installer re-run after the restart made 0 writes (%s after the restart began)", time.Since(t8).Round(time.Second))
}

func waitSA(t testing.TB, ctx context.Context, kube kubernetes.Interface, ns string) {
	t.Helper()
	if err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := kube.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	}); err != nil {
		t.Fatalf("no default ServiceAccount in %s", ns)
	}
}

// waitWebhookPods waits until exactly n webhook pods exist and none is terminating, so the next
// disturbance starts from a settled state.
func waitWebhookPods(t testing.TB, ctx context.Context, kube kubernetes.Interface, n int) {
	t.Helper()
	if err := wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		list, err := kube.CoreV1().Pods("berth-system").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=berth-webhook"})
		if err != nil || len(list.Items) != n {
			return false, nil
		}
		for _, p := range list.Items {
			if p.DeletionTimestamp != nil {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		t.Fatalf("webhook pods did not settle at %d", n)
	}
}
