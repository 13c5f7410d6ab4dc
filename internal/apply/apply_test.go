package apply

import (
	"context"
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	fakediscovery "k8s.io/client-go/discovery/fake"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	k8stesting "k8s.io/client-go/testing"
)

// discovers is a discovery of the core group's ConfigMaps and Namespaces.
func discovers() *fakediscovery.FakeDiscovery {
	return &fakediscovery.FakeDiscovery{Fake: &k8stesting.Fake{Resources: []*metav1.APIResourceList{{
		GroupVersion: "v1",
		APIResources: []metav1.APIResource{
			{Name: "configmaps", Kind: "ConfigMap", Namespaced: true, Verbs: metav1.Verbs{"get", "patch"}},
			{Name: "namespaces", Kind: "Namespace", Namespaced: false, Verbs: metav1.Verbs{"get", "patch"}},
		},
	}}}}
}

func TestResource(t *testing.T) {
	cm := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": "c", "namespace": "berth-system"},
	}}
	disc := discovers()
	a := New(dynamicfake.NewSimpleDynamicClient(runtime.NewScheme(), cm), disc)
	res, err := a.Resource(cm)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := res.Get(context.Background(), "c", metav1.GetOptions{}); err != nil {
		t.Fatalf("reading the ConfigMap through its resource: %v", err)
	}

	unknown := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "example.com/v1", "kind": "Widget", "metadata": map[string]any{"name": "w"}}}
	_, err = a.Resource(unknown)
	if !errors.Is(err, ErrUnknownKind) || !strings.Contains(err.Error(), "Widget") || !strings.Contains(err.Error(), "example.com/v1") {
		t.Errorf("Resource of an unknown kind = %v, want ErrUnknownKind naming the kind", err)
	}
	if err := a.Apply(context.Background(), unknown); !errors.Is(err, ErrUnknownKind) {
		t.Errorf("Apply of an unknown kind = %v, want ErrUnknownKind", err)
	}
	noNamespace := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "ConfigMap", "metadata": map[string]any{"name": "s"}}}
	if _, err := a.Resource(noNamespace); err == nil {
		t.Error("Resource of a namespaced object without namespace succeeded")
	}

	// A kind discovery learns about later (a CRD applied by someone else) is found: an unknown kind
	// is looked up again with a fresh discovery.
	disc.Resources = append(disc.Resources, &metav1.APIResourceList{GroupVersion: "example.com/v1", APIResources: []metav1.APIResource{
		{Name: "widgets", Kind: "Widget", Namespaced: false, Verbs: metav1.Verbs{"get", "patch"}},
	}})
	if _, err := a.Resource(unknown); err != nil {
		t.Errorf("Resource of a kind discovery has learnt since = %v", err)
	}
}

func TestUnstructured(t *testing.T) {
	obj, err := Unstructured(corev1ac.ConfigMap("c", "berth-system").WithData(map[string]string{"k": "v"}))
	if err != nil {
		t.Fatal(err)
	}
	if obj.GetAPIVersion() != "v1" || obj.GetKind() != "ConfigMap" || obj.GetName() != "c" || obj.GetNamespace() != "berth-system" {
		t.Fatalf("Unstructured = %v", obj.Object)
	}
	if v, _, _ := unstructured.NestedString(obj.Object, "data", "k"); v != "v" {
		t.Fatalf("data = %v", obj.Object["data"])
	}
	var typed corev1.ConfigMap
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj.Object, &typed); err != nil || typed.Data["k"] != "v" {
		t.Fatalf("the object does not decode as a ConfigMap: %v", err)
	}
	if _, err := Unstructured(corev1ac.ConfigMap("", "berth-system")); err == nil {
		t.Error("Unstructured of a configuration without a name succeeded")
	}
	if _, err := Unstructured(&corev1ac.ConfigMapApplyConfiguration{}); err == nil {
		t.Error("Unstructured of a configuration without a kind succeeded")
	}
}

// TestDecode: documents in order, empty ones skipped, a List's items as objects of their own, and
// an object without kind or name refused.
func TestDecode(t *testing.T) {
	objs, err := Decode([]byte(`---
apiVersion: v1
kind: ConfigMap
metadata: {name: a, namespace: x}
---
---
{"apiVersion": "v1", "kind": "List", "items": [
  {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "b", "namespace": "x"}},
  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "c"}}]}
`))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, o := range objs {
		got = append(got, o.GetKind()+"/"+o.GetName())
	}
	if strings.Join(got, " ") != "ConfigMap/a ServiceAccount/b Namespace/c" {
		t.Fatalf("Decode() = %v", got)
	}
	for _, bad := range []string{
		"apiVersion: v1\nkind: ConfigMap\nmetadata: {namespace: x}\n",
		`{"apiVersion": "v1", "kind": "List", "items": [{"apiVersion": "v1", "kind": "ConfigMap"}]}`,
		"kind: [\n",
	} {
		if _, err := Decode([]byte(bad)); err == nil {
			t.Errorf("Decode(%q) = nil error", bad)
		}
	}
}
