package components

import (
	"context"
	"errors"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestClusterPolicy(t *testing.T) {
	cm := func(data map[string]string) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: WebhookPolicyConfigMap, Namespace: Namespace}, Data: data}
	}
	p, err := clusterPolicy(context.Background(), fake.NewClientset(cm(map[string]string{"policy.yaml": "rules: []\n"})))
	if err != nil || string(p) != "rules: []\n" {
		t.Fatalf("clusterPolicy = %q, %v", p, err)
	}
	if _, err := clusterPolicy(context.Background(), fake.NewClientset(cm(nil))); !errors.Is(err, ErrWebhookInvalidConfiguration) {
		t.Errorf("no policy key: %v, want ErrWebhookInvalidConfiguration", err)
	}
	if _, err := clusterPolicy(context.Background(), fake.NewClientset()); !errors.Is(err, ErrWebhookInvalidConfiguration) {
		t.Errorf("no ConfigMap: %v, want ErrWebhookInvalidConfiguration", err)
	}
}

func TestReconcileWithoutWebhookImageDoesNothing(t *testing.T) {
	i := New(Config{}, nil)
	if err := i.Reconcile(context.Background(), "/nonexistent/admin.conf", nil); err != nil {
		t.Fatalf("Reconcile = %v", err)
	}
}
