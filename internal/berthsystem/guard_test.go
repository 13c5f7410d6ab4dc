package berthsystem_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/apply"
	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsstate"
)

// TestNamespaceGuardOnAPIServer runs the berth-system guard in a real kube-apiserver: foreign images
// are refused there (including as ephemeral containers), Berth's own images and other namespaces
// are not affected, and a pod keeps working under UPDATE after the allowed list changed.
func TestNamespaceGuardOnAPIServer(t *testing.T) {
	env := apiservertest.Start(t)
	ctx := context.Background()
	kube := env.Client(t, apiservertest.AdminUser)
	a, err := apply.NewForConfig(env.Config(apiservertest.AdminUser))
	if err != nil {
		t.Fatal(err)
	}
	guard := func(images ...string) {
		t.Helper()
		policy, binding := berthsystem.Guard(images)
		for _, ac := range []any{policy, binding} {
			o, err := apply.Unstructured(ac)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Apply(ctx, o); err != nil {
				t.Fatalf("applying the guard: %v", err)
			}
		}
	}
	for _, ns := range []string{joinconfig.Namespace, "apps"} {
		if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// No controller manager runs: create the default ServiceAccount pods are admitted with.
		if _, err := kube.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	guard("berth.local/joinservice:v1", "berth.local/berth-webhook:v1")
	pod := func(ns, name, image string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: image}}}}
	}
	create := func(ns, name, image string) error {
		_, err := kube.CoreV1().Pods(ns).Create(ctx, pod(ns, name, image), metav1.CreateOptions{})
		return err
	}
	// Wait until the policy is in force: the API server loads it asynchronously.
	var refusal error
	if err := wait.PollUntilContextTimeout(ctx, policyPoll, policyLoad, true, func(ctx context.Context) (bool, error) {
		_, refusal = kube.CoreV1().Pods(joinconfig.Namespace).Create(ctx, pod(joinconfig.Namespace, "probe", "evil.example/app:1"),
			metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return refusal != nil, nil
	}); err != nil {
		t.Fatalf("a foreign image in berth-system is still admitted %s after the guard was applied", policyLoad)
	}
	if !strings.Contains(refusal.Error(), berthsystem.GuardName) {
		t.Fatalf("foreign image refused, but not by the guard: %v", refusal)
	}
	t.Logf("refused: %v", refusal)
	if err := create(joinconfig.Namespace, "js", "berth.local/joinservice:v1"); err != nil {
		t.Fatalf("Berth's own image refused: %v", err)
	}
	if err := create("apps", "other", "evil.example/app:1"); err != nil {
		t.Fatalf("another namespace is affected: %v", err)
	}
	// An ephemeral debug container with a foreign image is refused.
	p, err := kube.CoreV1().Pods(joinconfig.Namespace).Get(ctx, "js", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p.Spec.EphemeralContainers = []corev1.EphemeralContainer{{EphemeralContainerCommon: corev1.EphemeralContainerCommon{Name: "debug", Image: "evil.example/shell:1"}}}
	if _, err := kube.CoreV1().Pods(joinconfig.Namespace).UpdateEphemeralContainers(ctx, "js", p, metav1.UpdateOptions{}); err == nil || !strings.Contains(err.Error(), berthsystem.GuardName) {
		t.Errorf("ephemeral container with a foreign image: %v, want refused by the guard", err)
	}
	// The allowed list changes (an upgrade): the running pod's metadata can still be changed.
	guard("berth.local/joinservice:v2", "berth.local/berth-webhook:v2")
	n := 0
	if err := wait.PollUntilContextTimeout(ctx, policyPoll, policyLoad, true, func(context.Context) (bool, error) {
		n++
		return create(joinconfig.Namespace, fmt.Sprintf("old-image-%d", n), "berth.local/joinservice:v1") != nil, nil
	}); err != nil {
		t.Fatalf("the formerly allowed image is still admitted for new pods %s after the list changed", policyLoad)
	}
	if _, err := kube.CoreV1().Pods(joinconfig.Namespace).Patch(ctx, "js", types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{}); err != nil {
		t.Errorf("label change of a pod running a formerly allowed image: %v", err)
	}
}

// The API server loads a changed ValidatingAdmissionPolicy asynchronously; the tests poll for it.
const (
	policyPoll = 100 * time.Millisecond
	policyLoad = 10 * time.Second
)

// TestJoinServiceRBACOnAPIServer: the joinservice's rights end at berth-system, and there at the
// objects it reads and writes, by name: the cluster Secret, the join ConfigMap (get, and list and watch
// by name, as its policy watcher does), the join ledger and the control-plane slot's Lease (get and
// update). It creates nothing but Events.
func TestJoinServiceRBACOnAPIServer(t *testing.T) {
	env := apiservertest.Start(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "measurements: {}\n"); err != nil {
		t.Fatal(err)
	}
	admin := env.Client(t, apiservertest.AdminUser)
	if _, err := admin.CoreV1().ConfigMaps(joinconfig.Namespace).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "other"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	js := env.Client(t, apiservertest.JoinServiceUser)
	cms := js.CoreV1().ConfigMaps(joinconfig.Namespace)
	byName := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", joinconfig.JoinConfigName).String()}
	allowed := map[string]func() error{
		"get the cluster Secret": func() error {
			_, err := js.CoreV1().Secrets(joinconfig.Namespace).Get(ctx, joinconfig.SecretName, metav1.GetOptions{})
			return err
		},
		"get the join ConfigMap":          func() error { _, err := cms.Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{}); return err },
		"list the join ConfigMap by name": func() error { _, err := cms.List(ctx, byName); return err },
		"read the KMS key spec": func() error {
			_, err := kmsstate.Read(ctx, js)
			return err
		},
		"watch the join ConfigMap by name": func() error {
			w, err := cms.Watch(ctx, byName)
			if err == nil {
				w.Stop()
			}
			return err
		},
		"update the ledger": func() error {
			cm, err := cms.Get(ctx, joinconfig.JoinLedgerName, metav1.GetOptions{})
			if err != nil {
				return err
			}
			cm.Data = map[string]string{"entries.json": "[]"}
			_, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
			return err
		},
		"update the Lease": func() error {
			l, err := js.CoordinationV1().Leases(joinconfig.Namespace).Get(ctx, joinconfig.ControlPlaneSlotLease, metav1.GetOptions{})
			if err != nil {
				return err
			}
			holder := "cp1"
			l.Spec.HolderIdentity = &holder
			_, err = js.CoordinationV1().Leases(joinconfig.Namespace).Update(ctx, l, metav1.UpdateOptions{})
			return err
		},
		"create an Event": func() error {
			_, err := js.CoreV1().Events(joinconfig.Namespace).Create(ctx, &corev1.Event{
				ObjectMeta:     metav1.ObjectMeta{GenerateName: "join-"},
				InvolvedObject: corev1.ObjectReference{Kind: "ConfigMap", Namespace: joinconfig.Namespace, Name: joinconfig.JoinLedgerName},
				Reason:         "Test", Message: "test", Type: corev1.EventTypeNormal,
			}, metav1.CreateOptions{})
			return err
		},
	}
	for name, call := range allowed {
		if err := call(); err != nil {
			t.Errorf("the joinservice may not %s: %v", name, err)
		}
	}
	refused := map[string]func() error{
		"list every ConfigMap":  func() error { _, err := cms.List(ctx, metav1.ListOptions{}); return err },
		"get another ConfigMap": func() error { _, err := cms.Get(ctx, "other", metav1.GetOptions{}); return err },
		"update the join config": func() error {
			_, err := cms.Update(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: joinconfig.JoinConfigName}}, metav1.UpdateOptions{})
			return err
		},
		"create a ConfigMap": func() error {
			_, err := cms.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "planted"}}, metav1.CreateOptions{})
			return err
		},
		"create a Lease": func() error {
			_, err := js.CoordinationV1().Leases(joinconfig.Namespace).Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "other"}}, metav1.CreateOptions{})
			return err
		},
		"delete the Lease": func() error {
			return js.CoordinationV1().Leases(joinconfig.Namespace).Delete(ctx, joinconfig.ControlPlaneSlotLease, metav1.DeleteOptions{})
		},
		"list the Secrets of berth-system": func() error {
			_, err := js.CoreV1().Secrets(joinconfig.Namespace).List(ctx, metav1.ListOptions{})
			return err
		},
		"list Secrets in kube-system": func() error {
			_, err := js.CoreV1().Secrets("kube-system").List(ctx, metav1.ListOptions{})
			return err
		},
		"create Secrets in kube-system": func() error {
			_, err := js.CoreV1().Secrets("kube-system").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "bootstrap-token-abcdef"}}, metav1.CreateOptions{})
			return err
		},
	}
	for name, call := range refused {
		if err := call(); !apierrors.IsForbidden(err) {
			t.Errorf("the joinservice may %s (%v), want Forbidden", name, err)
		}
	}
}
