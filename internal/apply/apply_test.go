package apply

import (
	"context"
	"errors"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
)

func TestResource(t *testing.T) {
	cm := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": "c", "namespace": "berth-system"},
	}}
	a := New(dynamicfake.NewSimpleDynamicClient(runtime.NewScheme(), cm))
	res, err := a.Resource(cm)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := res.Get(context.Background(), "c", metav1.GetOptions{}); err != nil {
		t.Fatalf("reading the ConfigMap through its resource: %v", err)
	}

	unknown := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "example.com/v1", "kind": "Widget", "metadata": map[string]any{"name": "w"}}}
	if _, err := a.Resource(unknown); !errors.Is(err, ErrUnknownKind) {
		t.Errorf("Resource of an unknown kind = %v, want ErrUnknownKind", err)
	}
	if err := a.Apply(context.Background(), unknown); !errors.Is(err, ErrUnknownKind) {
		t.Errorf("Apply of an unknown kind = %v, want ErrUnknownKind", err)
	}
	noNamespace := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Secret", "metadata": map[string]any{"name": "s"}}}
	if _, err := a.Resource(noNamespace); err == nil {
		t.Error("Resource of a namespaced object without namespace succeeded")
	}
}
