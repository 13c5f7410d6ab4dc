package install

import (
	"testing"

	appsv1ac "k8s.io/client-go/applyconfigurations/apps/v1"
)

func TestContains(t *testing.T) {
	have := map[string]any{"a": int64(1), "b": []any{map[string]any{"x": "y", "default": true}}, "status": map[string]any{}}
	for _, tc := range []struct {
		want any
		ok   bool
	}{
		{map[string]any{"a": int64(1)}, true},
		{map[string]any{"b": []any{map[string]any{"x": "y"}}}, true},
		{map[string]any{"a": int64(2)}, false},
		{map[string]any{"c": "missing"}, false},
		{map[string]any{"b": []any{map[string]any{"x": "y"}, map[string]any{}}}, false},
		{map[string]any{"b": map[string]any{}}, false},
	} {
		if got := contains(have, tc.want); got != tc.ok {
			t.Errorf("contains(%v) = %v, want %v", tc.want, got, tc.ok)
		}
	}
	// Desired objects come out of their typed apply configurations as a decoded live object has
	// them (numbers int64), so that an unchanged object compares equal to its live twin.
	d := typed(appsv1ac.Deployment("x", "ns").WithSpec(appsv1ac.DeploymentSpec().WithReplicas(2)))
	live := map[string]any{"apiVersion": "apps/v1", "kind": "Deployment",
		"metadata": map[string]any{"name": "x", "namespace": "ns", "uid": "u"},
		"spec":     map[string]any{"replicas": int64(2), "paused": false}}
	if !contains(live, d.Object) {
		t.Fatalf("desired object %v not contained in its live twin", d.Object)
	}
	live["spec"].(map[string]any)["replicas"] = int64(3)
	if contains(live, d.Object) {
		t.Fatal("desired object contained in a live object with other replicas")
	}
}
