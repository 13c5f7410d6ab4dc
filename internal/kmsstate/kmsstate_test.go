package kmsstate

import (
	"context"
	"errors"
	"testing"

	"go.uber.org/goleak"
	"k8s.io/client-go/kubernetes/fake"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestSpec(t *testing.T) {
	for name, s := range map[string]Spec{
		"empty":          {},
		"zero":           {Generations: []uint32{0}, Active: 0},
		"descending":     {Generations: []uint32{2, 1}, Active: 1},
		"twice":          {Generations: []uint32{1, 1}, Active: 1},
		"active missing": {Generations: []uint32{1, 2}, Active: 3},
	} {
		if err := s.Validate(); !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("%s: Validate = %v", name, err)
		}
	}
	s := Spec{Generations: []uint32{2, 3}, Active: 3}
	if err := s.Validate(); err != nil || !s.Holds([]uint32{2, 3}, 3) || s.Latest() != 3 {
		t.Errorf("Validate = %v, Holds = %v, Latest = %d", err, s.Holds([]uint32{2, 3}, 3), s.Latest())
	}
	if s.Holds([]uint32{2, 3}, 2) {
		t.Error("Holds ignores the active generation")
	}
	if s.Holds([]uint32{3}, 3) || s.Holds([]uint32{1, 2, 3}, 3) {
		t.Error("Holds ignores a generation")
	}
}

// A spec and reports written by their own managers come back through Read; a missing ConfigMap is the
// default spec, a report that does not decode is left out, a spec that does not is an error.
func TestReadAndApply(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset()
	st, err := Read(ctx, client)
	if err != nil || st.Found || st.Spec.Active != 1 || len(st.Spec.Generations) != 1 {
		t.Fatalf("Read without the ConfigMap = %+v, %v", st, err)
	}
	if err := ApplySpec(ctx, client, Spec{Generations: []uint32{1}, Active: 2}); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("ApplySpec(invalid) = %v", err)
	}
	if err := ApplyNodeStatus(ctx, client, "cp1", NodeStatus{Generations: []uint32{1}, Active: 1, Healthy: true}); err != nil {
		t.Fatal(err)
	}
	st, err = Read(ctx, client)
	if err != nil || !st.Found || !st.Nodes["cp1"].Healthy {
		t.Fatalf("after ApplyNodeStatus: %+v, %v", st, err)
	}
	if err := ApplySpec(ctx, client, Spec{Generations: []uint32{1, 2}, Active: 1, Scan: "x"}); err != nil {
		t.Fatal(err)
	}
	st, err = Read(ctx, client)
	if err != nil || st.Spec.Scan != "x" || st.Spec.Latest() != 2 {
		t.Fatalf("after ApplySpec: %+v, %v", st, err)
	}
	if _, err := Decode(map[string]string{KeySpec: "{"}); !errors.Is(err, ErrInvalidSpec) {
		t.Errorf("Decode(bad spec) = %v", err)
	}
	st, err = Decode(map[string]string{NodeKeyPrefix + "cp1": "{", NodeKeyPrefix + "cp2": `{"healthy":true}`, "other": "x"})
	if err != nil || len(st.Nodes) != 1 || !st.Nodes["cp2"].Healthy {
		t.Errorf("Decode(reports) = %+v, %v", st, err)
	}
}
