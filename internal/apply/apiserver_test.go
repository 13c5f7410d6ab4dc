package apply_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"go.uber.org/goleak"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/apply"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

// manifest is what a --components-dir file may hold: a CRD, a custom resource of it and a
// ConfigMap, in one stream.
const manifest = `apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: gadgets.berth-test.example.com
spec:
  group: berth-test.example.com
  scope: Namespaced
  names: {plural: gadgets, singular: gadget, kind: Gadget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
---
apiVersion: berth-test.example.com/v1
kind: Gadget
metadata: {name: first, namespace: default}
spec: {size: 3}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: after-the-gadget, namespace: default}
data: {k: v}
`

// TestApplyCRDAndItsResources: against a real API server, a manifest with a CRD and a custom resource
// of it applies in one go (the CRD is waited for until established, discovery is refreshed), a
// second apply is a no-op, and a kind no API server serves fails with ErrUnknownKind.
func TestApplyCRDAndItsResources(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	cfg := env.Config(apiservertest.AdminUser)
	objs, err := apply.Decode([]byte(manifest))
	if err != nil {
		t.Fatal(err)
	}
	a, err := apply.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// The mapper learns the core kinds before the CRD exists (its cache must not hide the new kind).
	if _, err := a.Resource(objs[2]); err != nil {
		t.Fatal(err)
	}
	if err := a.Apply(ctx, objs...); err != nil {
		t.Fatalf("applying a CRD and its custom resource: %v", err)
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	gadgets := dyn.Resource(schema.GroupVersionResource{Group: "berth-test.example.com", Version: "v1", Resource: "gadgets"}).Namespace("default")
	live, err := gadgets.Get(ctx, "first", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("reading the custom resource: %v", err)
	}
	rv := live.GetResourceVersion()
	if size, _, _ := unstructured.NestedInt64(live.Object, "spec", "size"); size != 3 {
		t.Fatalf("gadget spec %v, want size 3", live.Object["spec"])
	}
	var managed bool
	for _, f := range live.GetManagedFields() {
		managed = managed || (f.Manager == apply.FieldManager && f.Operation == metav1.ManagedFieldsOperationApply)
	}
	if !managed {
		t.Fatalf("the gadget is not server-side applied by %s: %+v", apply.FieldManager, live.GetManagedFields())
	}

	// Again, with a fresh Applier (a bootstrapper restart): nothing changes.
	again, err := apply.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := again.Apply(ctx, objs...); err != nil {
		t.Fatalf("applying again: %v", err)
	}
	if live, err := gadgets.Get(ctx, "first", metav1.GetOptions{}); err != nil || live.GetResourceVersion() != rv {
		t.Fatalf("re-applying changed the gadget (resourceVersion %s, was %s): %v", live.GetResourceVersion(), rv, err)
	}

	// A custom resource whose CRD nobody applied.
	unknown, err := apply.Decode([]byte("apiVersion: berth-test.example.com/v1\nkind: Doohickey\nmetadata: {name: d, namespace: default}\n"))
	if err != nil {
		t.Fatal(err)
	}
	err = a.Apply(ctx, unknown...)
	if !errors.Is(err, apply.ErrUnknownKind) || !strings.Contains(err.Error(), "applying Doohickey d") || !strings.Contains(err.Error(), "berth-test.example.com/v1") {
		t.Fatalf("applying a kind the API server does not serve = %v, want ErrUnknownKind naming it", err)
	}
}
