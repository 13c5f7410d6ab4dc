package nodelock

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"testing"
)

type recordingMarker struct{ marked [][]byte }

func (r *recordingMarker) MarkBootstrapped(_ context.Context, id []byte) error {
	r.marked = append(r.marked, bytes.Clone(id))
	return nil
}

func (r *recordingMarker) Bootstrapped(context.Context) (bool, error) { return len(r.marked) > 0, nil }

func TestForRole(t *testing.T) {
	cluster := bytes.Repeat([]byte{1}, 32)
	cp := ControlPlaneLockID(cluster)
	if bytes.Equal(cp, cluster) || len(cp) != sha256.Size || bytes.Equal(cp, ControlPlaneLockID(bytes.Repeat([]byte{2}, 32))) {
		t.Fatalf("ControlPlaneLockID(%x) = %x", cluster, cp)
	}
	for name, tc := range map[string]struct {
		controlPlane bool
		want         []byte
	}{
		"worker marks the cluster ID":            {false, cluster},
		"control plane marks its own lock value": {true, cp},
	} {
		t.Run(name, func(t *testing.T) {
			m := &recordingMarker{}
			r := ForRole(m, func(context.Context) (bool, error) { return tc.controlPlane, nil })
			if err := r.MarkBootstrapped(t.Context(), cluster); err != nil {
				t.Fatal(err)
			}
			if len(m.marked) != 1 || !bytes.Equal(m.marked[0], tc.want) {
				t.Fatalf("marked %x, want %x", m.marked, tc.want)
			}
			if ok, _ := r.Bootstrapped(t.Context()); !ok {
				t.Error("Bootstrapped does not pass through")
			}
		})
	}
	t.Run("unknown role marks nothing", func(t *testing.T) {
		m := &recordingMarker{}
		boom := errors.New("metadata unavailable")
		err := ForRole(m, func(context.Context) (bool, error) { return false, boom }).MarkBootstrapped(t.Context(), cluster)
		if !errors.Is(err, boom) || len(m.marked) != 0 {
			t.Fatalf("MarkBootstrapped = %v, marked %x", err, m.marked)
		}
	})
}
