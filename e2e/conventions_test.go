//go:build e2e

package e2e

import (
	"context"
	"encoding/json"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

// checkInClusterConventions checks berth-system on a running cluster as an operator sees it with
// kubectl get pods -n berth-system -o yaml: the namespace enforces Pod Security "restricted"; every
// pod runs with the default seccomp profile and requests CPU and memory; the joinservice runs on its
// ports 9002/9003 with the exempt RuntimeClass and no capabilities, is ready (its /readyz passes), and
// the webhook's pods run as non-root. Then the refusals that make the exemption safe, through the
// API server (dry run): the joinservice's pod without the RuntimeClass, and the RuntimeClass in
// another namespace.
func checkInClusterConventions(t testing.TB, c *cluster) {
	t.Helper()
	t.Logf("kubectl get namespace %s --show-labels:\n%s", joinconfig.Namespace, c.kube("get", "namespace", joinconfig.Namespace, "--show-labels"))
	t.Logf("kubectl get pods -n %s -o yaml:\n%s", joinconfig.Namespace, c.kube("get", "pods", "-n", joinconfig.Namespace, "-o", "yaml"))

	var ns corev1.Namespace
	if err := json.Unmarshal([]byte(c.kube("get", "namespace", joinconfig.Namespace, "-o", "json")), &ns); err != nil {
		t.Fatal(err)
	}
	for _, mode := range []string{"enforce", "audit", "warn"} {
		if got := ns.Labels["pod-security.kubernetes.io/"+mode]; got != "restricted" {
			t.Errorf("namespace %s: Pod Security %s = %q, want restricted", joinconfig.Namespace, mode, got)
		}
	}
	// Readiness is a probe's latest answer: under load one slow answer too many flips it for a
	// while, so the check below sees the joinservice after it was ready once more.
	c.kube("wait", "--for=condition=Ready", "pod", "-n", joinconfig.Namespace, "-l", "app.kubernetes.io/name="+joinconfig.JoinServiceName, "--timeout=2m")
	var pods corev1.PodList
	if err := json.Unmarshal([]byte(c.kube("get", "pods", "-n", joinconfig.Namespace, "-o", "json")), &pods); err != nil {
		t.Fatal(err)
	}
	joinServices := 0
	for _, p := range pods.Items {
		sp := p.Spec.SecurityContext
		if sp == nil || sp.SeccompProfile == nil || sp.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("pod %s: no RuntimeDefault seccomp profile", p.Name)
		}
		for _, ctr := range p.Spec.Containers {
			if ctr.Resources.Requests.Cpu().IsZero() || ctr.Resources.Requests.Memory().IsZero() || ctr.Resources.Limits.Memory().IsZero() {
				t.Errorf("pod %s container %s: resources %v, want CPU and memory requests and a memory limit", p.Name, ctr.Name, ctr.Resources)
			}
			sc := ctr.SecurityContext
			if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil ||
				!slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 ||
				sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("pod %s container %s: securityContext %+v, want no escalation, drop ALL, read-only root", p.Name, ctr.Name, sc)
			}
		}
		switch p.Labels["app.kubernetes.io/name"] {
		case joinconfig.JoinServiceName:
			joinServices++
			if p.Spec.RuntimeClassName == nil || *p.Spec.RuntimeClassName != berthsystem.HostRuntimeClass {
				t.Errorf("joinservice pod %s: runtimeClassName %v, want %s", p.Name, p.Spec.RuntimeClassName, berthsystem.HostRuntimeClass)
			}
			ports := map[string]int32{}
			for _, port := range p.Spec.Containers[0].Ports {
				ports[port.Name] = port.HostPort
			}
			if ports["join"] != joinconfig.JoinPort || ports["metrics"] != joinconfig.MetricsPort {
				t.Errorf("joinservice pod %s: host ports %v, want join %d, metrics %d", p.Name, ports, joinconfig.JoinPort, joinconfig.MetricsPort)
			}
			if !podReady(p) {
				t.Errorf("joinservice pod %s is not ready", p.Name)
			}
		default:
			if sp == nil || sp.RunAsNonRoot == nil || !*sp.RunAsNonRoot {
				t.Errorf("pod %s does not run as non-root", p.Name)
			}
		}
	}
	if joinServices == 0 {
		t.Errorf("no joinservice pod in %s", joinconfig.Namespace)
	}

	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(c.dir, "admin.conf"))
	if err != nil {
		t.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := kube.AppsV1().DaemonSets(joinconfig.Namespace).Get(context.Background(), joinconfig.JoinServiceName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dryRun := func(ns string, mutate func(*corev1.Pod)) error {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "conventions-check", Namespace: ns}, Spec: *ds.Spec.Template.Spec.DeepCopy()}
		pod.Spec.ServiceAccountName, pod.Spec.DeprecatedServiceAccount = "", ""
		mutate(pod)
		_, err := kube.CoreV1().Pods(ns).Create(context.Background(), pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	if err := dryRun(joinconfig.Namespace, func(p *corev1.Pod) { p.Spec.RuntimeClassName = nil }); err == nil ||
		!strings.Contains(err.Error(), `violates PodSecurity "restricted`) {
		t.Errorf("the joinservice's pod without RuntimeClass %s in %s: %v, want refused by Pod Security", berthsystem.HostRuntimeClass, joinconfig.Namespace, err)
	} else {
		t.Logf("refused as it should be: %v", err)
	}
	if err := dryRun("default", func(*corev1.Pod) {}); err == nil || !strings.Contains(err.Error(), berthsystem.HostRuntimeGuardName) {
		t.Errorf("RuntimeClass %s in namespace default: %v, want refused by %s", berthsystem.HostRuntimeClass, err, berthsystem.HostRuntimeGuardName)
	} else {
		t.Logf("refused as it should be: %v", err)
	}
}

func podReady(p corev1.Pod) bool {
	for _, cond := range p.Status.Conditions {
		if cond.Type == corev1.PodReady {
			return cond.Status == corev1.ConditionTrue
		}
	}
	return false
}
