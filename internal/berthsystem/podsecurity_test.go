package berthsystem_test

import (
	"context"
	"strings"
	"testing"

	"github.com/spf13/afero"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/webhook/install"
	"github.com/berth-k8s/berth/internal/webhookconfig"
)

const testWebhookImage = "berth.local/berth-webhook:v1"

// podFromTemplate is a pod of the pod template in the object of kind and name, in namespace.
func podFromTemplate(t *testing.T, objs []*unstructured.Unstructured, kind, name, namespace string) *corev1.Pod {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() != kind || o.GetName() != name {
			continue
		}
		tmpl, ok, err := unstructured.NestedMap(o.Object, "spec", "template")
		if err != nil || !ok {
			t.Fatalf("%s %s has no pod template: %v", kind, name, err)
		}
		pod := &corev1.Pod{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(tmpl, pod); err != nil {
			t.Fatal(err)
		}
		pod.Name, pod.Namespace = strings.ToLower(kind)+"-pod", namespace
		return pod
	}
	t.Fatalf("no %s %s", kind, name)
	return nil
}

// TestPodSecurityOnAPIServer runs berth-system's Pod Security in a real kube-apiserver started with
// the admission configuration every control plane gets: the namespace enforces restricted, so the
// webhook's pods are admitted and the joinservice's pod is refused without its RuntimeClass and
// admitted with it; the RuntimeClass is refused in another namespace and for another image, also one
// the image guard allows in berth-system.
func TestPodSecurityOnAPIServer(t *testing.T) {
	admission, err := berthsystem.WriteAdmissionConfiguration(afero.NewOsFs(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	env := apiservertest.Start(t, apiservertest.APIServerArgs("--allow-privileged=true", "--admission-control-config-file="+admission))
	ctx := context.Background()
	kube := env.Client(t, apiservertest.AdminUser)
	a, err := apply.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	objs := testObjects(t, berthsystem.Config{GuardImages: []string{testWebhookImage}, JoinServiceHostPaths: []string{"/run/swtpm"}})
	if err := a.Apply(ctx, objs...); err != nil {
		t.Fatal(err)
	}
	webhookObjs, err := install.Objects(install.Config{Image: testWebhookImage}, []byte("ca"))
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range webhookObjs {
		if o.GetKind() == "ServiceAccount" && o.GetNamespace() == joinconfig.Namespace {
			if err := a.Apply(ctx, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, ns := range []string{"apps"} {
		if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// No controller manager runs: the ServiceAccounts pods are admitted with.
	for _, sa := range []struct{ ns, name string }{{joinconfig.Namespace, "default"}, {"apps", "default"}, {"apps", joinconfig.ServiceAccountName}} {
		if _, err := kube.CoreV1().ServiceAccounts(sa.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa.name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	create := func(pod *corev1.Pod) error {
		_, err := kube.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	joinService := func(ns string) *corev1.Pod {
		return podFromTemplate(t, objs, "DaemonSet", joinconfig.JoinServiceName, ns)
	}

	// The RuntimeClass guard is loaded asynchronously: wait until it refuses the joinservice's pod
	// in another namespace.
	var refusal error
	if err := wait.PollUntilContextTimeout(ctx, policyPoll, policyLoad, true, func(context.Context) (bool, error) {
		refusal = create(joinService("apps"))
		return refusal != nil, nil
	}); err != nil {
		t.Fatalf("the joinservice's pod with RuntimeClass %s is admitted in another namespace %s after the guard was applied", berthsystem.HostRuntimeClass, policyLoad)
	}
	if !strings.Contains(refusal.Error(), berthsystem.HostRuntimeGuardName) {
		t.Fatalf("RuntimeClass in another namespace refused, but not by the guard: %v", refusal)
	}

	if err := create(joinService(joinconfig.Namespace)); err != nil {
		t.Errorf("the joinservice's pod is refused in berth-system: %v", err)
	}
	noClass := joinService(joinconfig.Namespace)
	noClass.Spec.RuntimeClassName = nil
	if err := create(noClass); err == nil || !strings.Contains(err.Error(), `violates PodSecurity "restricted:`+k8sversion.Default().Minor()+`"`) {
		t.Errorf("the joinservice's pod without RuntimeClass %s: %v, want refused by PodSecurity restricted", berthsystem.HostRuntimeClass, err)
	} else {
		t.Logf("refused: %v", err)
	}
	// The webhook's image is allowed in berth-system, but not with the RuntimeClass.
	other := joinService(joinconfig.Namespace)
	other.Spec.Containers[0].Image = testWebhookImage
	if err := create(other); err == nil || !strings.Contains(err.Error(), berthsystem.HostRuntimeGuardName) {
		t.Errorf("another image with RuntimeClass %s: %v, want refused by %s", berthsystem.HostRuntimeClass, err, berthsystem.HostRuntimeGuardName)
	}
	webhookPod := podFromTemplate(t, webhookObjs, "Deployment", webhookconfig.Name, joinconfig.Namespace)
	if err := create(webhookPod); err != nil {
		t.Errorf("the webhook's pod is refused in berth-system: %v", err)
	}
	assertRestrictedWarningFree(t, env, webhookPod)
}

// assertRestrictedWarningFree creates pod (dry run) and fails on any warning: PodSecurity warns about
// what "restricted" forbids, so an admitted pod that still draws a warning would not pass enforcement.
func assertRestrictedWarningFree(t *testing.T, env *apiservertest.Env, pod *corev1.Pod) {
	t.Helper()
	cfg := env.Config(apiservertest.AdminUser)
	var warnings warningRecorder
	cfg.WarningHandler = &warnings
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kube.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}); err != nil {
		t.Fatal(err)
	}
	if len(warnings) > 0 {
		t.Errorf("warnings for %s: %v", pod.Name, warnings)
	}
}

type warningRecorder []string

func (w *warningRecorder) HandleWarningHeader(_ int, _ string, text string) { *w = append(*w, text) }
