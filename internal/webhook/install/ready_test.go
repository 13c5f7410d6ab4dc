package install

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/berth-k8s/berth/internal/webhookconfig"

	"github.com/berth-k8s/berth/internal/webhook"
)

func TestReadyAddresses(t *testing.T) {
	yes, no := true, false
	port, name := int32(8443), "https"
	slices := []discoveryv1.EndpointSlice{{
		Ports: []discoveryv1.EndpointPort{{Name: &name, Port: &port}},
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"198.51.100.12"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes}},
			{Addresses: []string{"198.51.100.11"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes, Terminating: &no}},
			{Addresses: []string{"198.51.100.13"}, Conditions: discoveryv1.EndpointConditions{Ready: &no}},
			{Addresses: []string{"198.51.100.14"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes, Terminating: &yes}},
			{Addresses: []string{"198.51.100.15"}},
		},
	}}
	got := strings.Join(readyAddresses(slices), " ")
	if got != "198.51.100.11:8443 198.51.100.12:8443" {
		t.Fatalf("readyAddresses = %s", got)
	}
}

// serveWebhook runs the real handler over TLS on loopback with the keypair from the Secret.
func serveWebhook(t *testing.T, secret *corev1.Secret, policy string) string {
	t.Helper()
	pair, err := tls.X509KeyPair(secret.Data["tls.crt"], secret.Data["tls.key"])
	if err != nil {
		t.Fatal(err)
	}
	h := webhook.NewHandler(zap.NewNop(), []string{"kube-system"}, time.Second, nil)
	p, err := webhook.ParsePolicy([]byte(policy))
	if err != nil {
		t.Fatal(err)
	}
	h.SetPolicy(p)
	srv := httptest.NewUnstartedServer(h)
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{pair}}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// TestProbe is the TLS probe of every endpoint against the real handler over real TLS: the right CA
// passes, a foreign CA is the x509 category, a policy that allows the denied canary is the
// wrong-response category.
func TestProbe(t *testing.T) {
	now := time.Now()
	w := installer(t, now)
	u, caPEM, err := w.tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	secret := secretFrom(u)
	addr := serveWebhook(t, secret, webhook.DefaultPolicy)
	if err := w.probeAll(context.Background(), caPEM, []string{addr}); err != nil {
		t.Fatalf("probe = %v", err)
	}
	_, otherCA, err := installer(t, now).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := w.probeAll(context.Background(), otherCA, []string{addr}); !errors.Is(err, ErrTLSMismatch) {
		t.Fatalf("probe with a foreign CA = %v, want ErrTLSMismatch", err)
	}
	permissive := serveWebhook(t, secret, "rules: [{name: all, registries: [canary.invalid, registry.k8s.io]}]")
	if err := w.probeAll(context.Background(), caPEM, []string{permissive}); !errors.Is(err, ErrWrongResponse) {
		t.Fatalf("probe of a webhook that allows the canary = %v, want ErrWrongResponse", err)
	}
	// Nothing listening: not a TLS problem, an endpoint problem.
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := l.Addr().String()
	l.Close()
	if err := w.probeAll(context.Background(), caPEM, []string{dead}); !errors.Is(err, ErrNoReadyEndpoints) {
		t.Fatalf("probe of a closed port = %v, want ErrNoReadyEndpoints", err)
	}
	var we *Error
	if !errors.As(w.probeAll(context.Background(), otherCA, []string{addr}), &we) || we.Hint == "" {
		t.Fatal("failure without a hint")
	}
}

// TestWaitServingKeepsTheLastCompleteRound: when the budget ends during a request, the install
// fails with what the last complete round saw, not with the cut request's deadline (CI saw a
// foreign certificate reported as "Deployment not available: context deadline exceeded").
func TestWaitServingKeepsTheLastCompleteRound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cs := fake.NewClientset(&appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Name: webhookconfig.Name, Namespace: namespace, Generation: 1},
			Status: appsv1.DeploymentStatus{ObservedGeneration: 1, UpdatedReplicas: 2, AvailableReplicas: 2,
				Conditions: []appsv1.DeploymentCondition{{Type: appsv1.DeploymentAvailable, Status: corev1.ConditionTrue}}},
		})
		gets := 0
		cs.PrependReactor("get", "deployments", func(k8stesting.Action) (bool, runtime.Object, error) {
			gets++
			if gets == 1 {
				return false, nil, nil
			}
			// The API server is slow: the answer comes after the budget.
			time.Sleep(time.Minute)
			return true, nil, context.DeadlineExceeded
		})
		w := New(Config{Image: "berth.local/webhook:test"}, cs, nil, io.Discard)
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err := w.waitServing(ctx, nil)
		if !errors.Is(err, ErrServiceMissing) {
			t.Fatalf("waitServing = %v, want the last complete round's ErrServiceMissing", err)
		}
		if gets < 2 {
			t.Fatalf("%d Deployment reads: the test did not cut a request short", gets)
		}
	})
}
