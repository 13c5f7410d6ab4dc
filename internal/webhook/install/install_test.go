package install

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/berth-k8s/berth/internal/webhookconfig"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func installer(t *testing.T, now time.Time, objs ...any) *Installer {
	t.Helper()
	cs := fake.NewSimpleClientset()
	for _, o := range objs {
		if s, ok := o.(*corev1.Secret); ok {
			if _, err := cs.CoreV1().Secrets(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	w := New(Config{Image: "berth.local/webhook:test", Now: func() time.Time { return now }}, cs, nil, io.Discard)
	return w
}

func secretFrom(u *unstructured.Unstructured) *corev1.Secret {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: u.GetName(), Namespace: u.GetNamespace()}, Data: map[string][]byte{}}
	data, _, _ := unstructured.NestedStringMap(u.Object, "data")
	for k, v := range data {
		b, _ := base64.StdEncoding.DecodeString(v)
		s.Data[k] = b
	}
	return s
}

func TestInstallRefusesBadInput(t *testing.T) {
	w := New(Config{}, fake.NewSimpleClientset(), nil, io.Discard)
	if _, err := w.Install(context.Background()); !errors.Is(err, ErrInvalidConfiguration) {
		t.Fatalf("Install without image = %v", err)
	}
	w = New(Config{Image: "x", Policy: []byte("rules: 1")}, fake.NewSimpleClientset(), nil, io.Discard)
	if _, err := w.Install(context.Background()); !errors.Is(err, ErrInvalidConfiguration) {
		t.Fatalf("Install with a bad policy = %v", err)
	}
}

func TestClusterPolicy(t *testing.T) {
	cm := func(data map[string]string) *corev1.ConfigMap {
		return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.PolicyConfigMap, Namespace: namespace}, Data: data}
	}
	p, err := clusterPolicy(context.Background(), fake.NewClientset(cm(map[string]string{"policy.yaml": "rules: []\n"})))
	if err != nil || string(p) != "rules: []\n" {
		t.Fatalf("clusterPolicy = %q, %v", p, err)
	}
	if _, err := clusterPolicy(context.Background(), fake.NewClientset(cm(nil))); !errors.Is(err, ErrInvalidConfiguration) {
		t.Errorf("no policy key: %v, want ErrInvalidConfiguration", err)
	}
	if _, err := clusterPolicy(context.Background(), fake.NewClientset()); !errors.Is(err, ErrInvalidConfiguration) {
		t.Errorf("no ConfigMap: %v, want ErrInvalidConfiguration", err)
	}
}

func TestReconcileWithoutImageDoesNothing(t *testing.T) {
	if err := Reconcile(context.Background(), Config{}, "/nonexistent/admin.conf", nil); err != nil {
		t.Fatalf("Reconcile = %v", err)
	}
}

// TestRetryBackoffKeepsItsNumbers: each wait is between half of a nominal wait and all of it; the
// nominal wait starts at 200 ms and doubles up to the cap (the first one is not capped).
func TestRetryBackoffKeepsItsNumbers(t *testing.T) {
	for _, maxWait := range []time.Duration{10 * time.Second, readyPoll, 100 * time.Millisecond} {
		b := retryBackoff(maxWait)
		nominal := retryFirstWait
		for step := range 20 {
			if d := b.Step(); d < nominal/2 || d > nominal {
				t.Errorf("cap %s, wait %d: %s, want between %s and %s", maxWait, step, d, nominal/2, nominal)
			}
			nominal = min(2*nominal, maxWait)
		}
	}
}

// TestRetryReturnsTheLastError: retry keeps calling until ctx ends and then returns f's last error,
// or stops at once when f is done.
func TestRetryReturnsTheLastError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		calls := 0
		err := retry(ctx, 10*time.Second, func() (bool, error) {
			calls++
			return false, fmt.Errorf("attempt %d", calls)
		})
		if err == nil || err.Error() != fmt.Sprintf("attempt %d", calls) {
			t.Fatalf("retry = %v after %d calls, want the last attempt's error", err, calls)
		}
		// A minute holds at least 11 attempts (every wait at its longest) and at most 18 (at its
		// shortest).
		if calls < 11 || calls > 18 {
			t.Errorf("%d attempts in a minute", calls)
		}

		done := errors.New("done")
		calls = 0
		if err := retry(t.Context(), 10*time.Second, func() (bool, error) {
			calls++
			return calls == 3, done
		}); !errors.Is(err, done) || calls != 3 {
			t.Errorf("retry = %v after %d calls, want done after 3", err, calls)
		}
	})
}

// TestClusterPolicyRetriesUntilTheBudgetEnds: while the API server does not answer, the policy is
// read again after 0.5, 1, 2 and 4 s, then every 5 s; when the budget ends the install fails as
// "API server not ready".
func TestClusterPolicyRetriesUntilTheBudgetEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cs := fake.NewClientset()
		var at []time.Duration
		start := time.Now()
		cs.PrependReactor("get", "configmaps", func(k8stesting.Action) (bool, runtime.Object, error) {
			at = append(at, time.Since(start))
			return true, nil, errors.New("connection refused")
		})
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		if _, err := clusterPolicy(ctx, cs); !errors.Is(err, ErrAPINotReady) {
			t.Fatalf("clusterPolicy = %v, want ErrAPINotReady", err)
		}
		want := []time.Duration{0, 500 * time.Millisecond, 1500 * time.Millisecond, 3500 * time.Millisecond, 7500 * time.Millisecond,
			12500 * time.Millisecond, 17500 * time.Millisecond, 22500 * time.Millisecond, 27500 * time.Millisecond}
		if !slices.Equal(at, want) {
			t.Errorf("reads at %v, want %v", at, want)
		}
	})
}
