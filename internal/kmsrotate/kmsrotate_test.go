package kmsrotate

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/kmsstate"
)

// The rotation against a real API server, etcd and keeper is bootstrapper/kmskeeper's
// TestRotationUnderLoad; these are the refusals.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func controlPlane(name string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{ControlPlaneLabel: ""}}}
}

var fast = Options{StepTimeout: 300 * time.Millisecond, Poll: 20 * time.Millisecond}

// A control plane that never reports stops the rotation at its first step, named, with the new
// generation added but not active: nothing is encrypted under a key some plugin lacks.
func TestRotateWaitsForEveryControlPlane(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(controlPlane("cp1"), controlPlane("cp2"))
	if err := kmsstate.ApplyNodeStatus(ctx, client, "cp1", kmsstate.NodeStatus{Generations: []uint32{1, 2}, Active: 1, Healthy: true,
		KeyIDs: map[string]string{"1": "berth:g1:1111111111111111", "2": "berth:g2:2222222222222222"}}); err != nil {
		t.Fatal(err)
	}
	_, err := Rotate(ctx, client, fast)
	if !errors.Is(err, ErrNotReached) || !strings.Contains(err.Error(), "cp2 (no report)") || strings.Contains(err.Error(), "cp1") {
		t.Fatalf("Rotate = %v, want ErrNotReached naming cp2 only", err)
	}
	st, _ := kmsstate.Read(ctx, client)
	if st.Spec.Active != 1 || st.Spec.Latest() != 2 {
		t.Errorf("spec after the refusal = %+v, want generation 2 added, 1 active", st.Spec)
	}

	if _, err := Rotate(ctx, fake.NewClientset(), fast); !errors.Is(err, ErrNotReached) || !strings.Contains(err.Error(), ErrNoControlPlanes.Error()) {
		t.Errorf("Rotate without control planes = %v", err)
	}
}

// Two control planes with different keys for one generation (different master secrets) stop the
// rotation before the new key becomes active.
func TestRotateRefusesDisagreeingKeys(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(controlPlane("cp1"), controlPlane("cp2"))
	for node, id := range map[string]string{"cp1": "berth:g2:2222222222222222", "cp2": "berth:g2:3333333333333333"} {
		if err := kmsstate.ApplyNodeStatus(ctx, client, node, kmsstate.NodeStatus{Generations: []uint32{1, 2}, Active: 1, Healthy: true,
			KeyIDs: map[string]string{"1": "berth:g1:1111111111111111", "2": id}}); err != nil {
			t.Fatal(err)
		}
	}
	_, err := Rotate(ctx, client, fast)
	if !errors.Is(err, ErrDisagree) {
		t.Fatalf("Rotate = %v, want ErrDisagree", err)
	}
	if st, _ := kmsstate.Read(ctx, client); st.Spec.Active != 1 {
		t.Errorf("generation %d became active although the control planes disagree", st.Spec.Active)
	}
}
