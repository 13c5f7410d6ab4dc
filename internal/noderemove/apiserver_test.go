package noderemove

import (
	"context"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/machines"
)

// impersonator returns Options.AsNode for env's admin, as the CLI builds it.
func impersonator(env *apiservertest.Env) func(string) (kubernetes.Interface, error) {
	return func(node string) (kubernetes.Interface, error) {
		cfg := env.Config(apiservertest.AdminUser)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: berthsystem.NodeUserPrefix + node, Groups: []string{"system:nodes", "system:authenticated"}}
		return kubernetes.NewForConfig(cfg)
	}
}

// nodeCluster is a real API server authorizing kubelets as a kubeadm cluster does, with nodes w1
// and w2 registered by their kubelets, pod app bound to w2 and mounting Secret app-secret, and the
// machine record admitting both. With install, Berth's objects (and its revocation policy) are
// installed; without, only the namespace.
func nodeCluster(t *testing.T, install bool) (*apiservertest.Env, kubernetes.Interface) {
	t.Helper()
	env := apiservertest.Start(t, apiservertest.Nodes("w1", "w2"))
	ctx := context.Background()
	admin := env.Client(t, apiservertest.AdminUser)
	if install {
		if err := env.InstallBerth(ctx, "variant: insecure-none\n"); err != nil {
			t.Fatal(err)
		}
	} else if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.Namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"w1", "w2"} {
		if _, err := env.Client(t, apiservertest.NodeUser(n)).CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s registering: %v", n, err)
		}
	}
	// No controller manager runs: the default ServiceAccount pods are admitted with.
	if _, err := admin.CoreV1().ServiceAccounts(metav1.NamespaceDefault).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Secrets(metav1.NamespaceDefault).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "app-secret"},
		Data: map[string][]byte{"k": []byte("v")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.CoreV1().Pods(metav1.NamespaceDefault).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "app"},
		Spec: corev1.PodSpec{NodeName: "w2", AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{Name: "c", Image: "app:1"}},
			Volumes:    []corev1.Volume{{Name: "s", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "app-secret"}}}}}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := machines.Update(ctx, admin, joinconfig.Namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
		ms, _ = machines.Admit(ms, machines.Machine{Identity: idW1, Node: "w1", Role: machines.RoleWorker},
			machines.Machine{Identity: "cc" + idW1[2:], Node: "w2", Role: machines.RoleWorker})
		return ms, nil
	}); err != nil {
		t.Fatal(err)
	}
	return env, admin
}

// readsSecret waits until node's kubelet may read app-secret (want) or may not, and returns how
// long the wait took and the last answer.
func readsSecret(t *testing.T, kubelet kubernetes.Interface, want bool) (time.Duration, error) {
	t.Helper()
	start := time.Now()
	var last error
	if err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		_, last = kubelet.CoreV1().Secrets(metav1.NamespaceDefault).Get(ctx, "app-secret", metav1.GetOptions{})
		return (last == nil) == want, nil
	}); err != nil {
		t.Fatalf("reading app-secret allowed = %v for 30s, want %v: %v", !want, want, last)
	}
	return time.Since(start), last
}

// TestRemoveOnAPIServer: on a real API server with Berth installed, removing w2 makes the API
// server refuse its kubelet's registration and status writes (and not w1's), and, with its Node
// and its pod gone, the Node authorizer lets it read the pod's Secret no more (it could before);
// a re-admission lets it register again.
func TestRemoveOnAPIServer(t *testing.T) {
	env, admin := nodeCluster(t, true)
	ctx := context.Background()
	w1, w2 := env.Client(t, apiservertest.NodeUser("w1")), env.Client(t, apiservertest.NodeUser("w2"))
	if took, _ := readsSecret(t, w2, true); took > 0 {
		t.Logf("before the removal w2's kubelet reads the Secret of its pod (%.2fs)", took.Seconds())
	}
	r, err := Remove(ctx, admin, "w2", Options{Namespace: joinconfig.Namespace, AsNode: impersonator(env)})
	if err != nil {
		t.Fatalf("remove: %v", err)
	}
	t.Logf("removed: %s", r.Message())
	if r.Refused <= 0 || !r.NodeDeleted || r.PodsDeleted != 1 {
		t.Fatalf("result %+v: want the refusal timed, the Node deleted and 1 bound pod deleted", r)
	}
	_, err = w2.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w2"}}, metav1.CreateOptions{})
	if !RefusedByRevocation(err) {
		t.Fatalf("w2's kubelet registering again after the removal: %v, want refused by %s", err, berthsystem.RevocationName)
	}
	t.Logf("w2's kubelet registering again: %v", err)
	took, last := readsSecret(t, w2, false)
	if !apierrors.IsForbidden(last) {
		t.Fatalf("w2 reading app-secret: %v, want forbidden", last)
	}
	t.Logf("w2's kubelet reading its former pod's Secret, %.2fs after the removal: %v", took.Seconds(), last)
	if _, err := w1.CoreV1().Nodes().Patch(ctx, "w1", "application/merge-patch+json", []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{}); err != nil {
		t.Errorf("w1's kubelet writing its Node: %v", err)
	}

	if _, err := Readmit(ctx, admin, "w2", Options{Namespace: joinconfig.Namespace, AsNode: impersonator(env)}); err != nil {
		t.Fatalf("readmit: %v", err)
	}
	if _, err := w2.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "w2"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("w2's kubelet registering after the re-admission: %v", err)
	}
}

// TestRemoveWithoutPolicy: on an API server without Berth's revocation policy, Remove reports that
// the API server still accepts the node's writes instead of claiming a revocation it does not have.
func TestRemoveWithoutPolicy(t *testing.T) {
	env, admin := nodeCluster(t, false)
	_, err := Remove(context.Background(), admin, "w2", Options{Namespace: joinconfig.Namespace, AsNode: impersonator(env), RefusalTimeout: 2 * time.Second})
	if !errors.Is(err, ErrNotRefused) {
		t.Fatalf("remove without the policy: %v, want ErrNotRefused", err)
	}
	t.Logf("remove without the policy: %v", err)
}
