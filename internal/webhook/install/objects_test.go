package install

import (
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
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
	// Desired objects compare after normalization (ints become int64 as in decoded objects).
	d := normalize(&unstructured.Unstructured{Object: map[string]any{"kind": "X", "spec": map[string]any{"replicas": 2}}})
	if !contains(map[string]any{"kind": "X", "spec": map[string]any{"replicas": int64(2), "paused": false}}, d.Object) {
		t.Fatal("normalized desired object not contained in its live twin")
	}
}
