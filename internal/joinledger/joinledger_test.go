package joinledger

import (
	"context"
	"errors"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestReadWhatEncodeWrote(t *testing.T) {
	es := []Entry{
		{Time: time.Date(2026, 11, 21, 6, 0, 0, 0, time.UTC), Peer: "198.51.100.11", Node: "worker-0", RPC: "join", Outcome: OutcomeAccepted},
		{Time: time.Date(2026, 11, 21, 6, 0, 1, 0, time.UTC), Peer: "203.0.113.9", RPC: "join", Outcome: OutcomeRejected, Reason: "RATE_LIMITED", Count: 40},
	}
	data, err := Encode(es)
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(&corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: ConfigMapName, Namespace: "berth-system"},
		Data:       map[string]string{DataKey: data},
	})
	got, err := Read(context.Background(), client, "berth-system")
	if err != nil || len(got) != 2 || got[0] != es[0] || got[1] != es[1] {
		t.Fatalf("Read() = %+v, %v; want %+v", got, err, es)
	}
}

func TestReadWithoutLedger(t *testing.T) {
	if _, err := Read(context.Background(), fake.NewClientset(), "berth-system"); !errors.Is(err, ErrNoLedger) {
		t.Fatalf("Read() = %v, want ErrNoLedger", err)
	}
}

func TestDecode(t *testing.T) {
	for name, tc := range map[string]struct {
		in      string
		n       int
		wantErr bool
	}{
		"empty":        {in: "", n: 0},
		"blank":        {in: " \n", n: 0},
		"one":          {in: `[{"time":"2026-11-21T06:00:00Z","peer":"198.51.100.11","outcome":"accepted"}]`, n: 1},
		"not an array": {in: `{"peer":"x"}`, wantErr: true},
	} {
		t.Run(name, func(t *testing.T) {
			es, err := Decode(tc.in)
			if (err != nil) != tc.wantErr || len(es) != tc.n {
				t.Fatalf("Decode(%q) = %d entries, %v", tc.in, len(es), err)
			}
		})
	}
}
