package components

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/webhook"
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

func installer(t *testing.T, now time.Time, objs ...any) *WebhookInstaller {
	t.Helper()
	cs := fake.NewSimpleClientset()
	for _, o := range objs {
		if s, ok := o.(*corev1.Secret); ok {
			if _, err := cs.CoreV1().Secrets(s.Namespace).Create(context.Background(), s, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
	}
	w := NewWebhookInstaller(WebhookConfig{Image: "berth.local/webhook:test", Now: func() time.Time { return now }}, cs, nil, io.Discard)
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

// TestTLSSecretReuse is B3: a valid Secret is reused byte for byte, a leaf past 2/3 of its life is
// renewed from the same CA, and an unusable CA is replaced.
func TestTLSSecretReuse(t *testing.T) {
	now := time.Date(2026, 11, 21, 0, 0, 0, 0, time.UTC)
	first, ca1, err := installer(t, now).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	existing := secretFrom(first)

	again, ca2, err := installer(t, now.Add(24*time.Hour), existing).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ca1, ca2) || !contains(normalize(first).Object, normalize(again).Object) {
		t.Fatal("a valid Secret was not reused as is")
	}

	renewed, ca3, err := installer(t, now.Add(250*24*time.Hour), existing).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ca1, ca3) {
		t.Fatal("renewing the leaf replaced the CA")
	}
	if secretFrom(renewed).Data["tls.crt"] == nil || bytes.Equal(secretFrom(renewed).Data["tls.crt"], existing.Data["tls.crt"]) {
		t.Fatal("a leaf past 2/3 of its life was not renewed")
	}

	broken := existing.DeepCopy()
	broken.Data["ca.key"] = []byte("garbage")
	_, ca4, err := installer(t, now, broken).tlsSecret(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(ca1, ca4) {
		t.Fatal("a CA without a usable key was kept")
	}
}

func TestConfigurationShape(t *testing.T) {
	w := installer(t, time.Now())
	cfg := w.ValidatingWebhookConfiguration([]byte("CA"), false)
	hooks, _, _ := unstructured.NestedSlice(cfg.Object, "webhooks")
	if len(hooks) != 1 {
		t.Fatalf("%d webhooks", len(hooks))
	}
	h := hooks[0].(map[string]any)
	for k, v := range map[string]any{"failurePolicy": "Fail", "sideEffects": "None", "matchPolicy": "Equivalent", "timeoutSeconds": int64(5)} {
		if h[k] != v {
			t.Errorf("%s = %v, want %v", k, h[k], v)
		}
	}
	expr, _, _ := unstructured.NestedSlice(h, "namespaceSelector", "matchExpressions")
	sel := expr[0].(map[string]any)
	if sel["key"] != "kubernetes.io/metadata.name" || sel["operator"] != "NotIn" {
		t.Fatalf("namespaceSelector = %v", sel)
	}
	for _, ns := range []string{"kube-system", "kube-node-lease", "kube-public", "berth-system"} {
		if !strings.Contains(strings.Join(toStrings(sel["values"]), ","), ns) {
			t.Errorf("namespace %s is not exempt", ns)
		}
	}
	conds, _, _ := unstructured.NestedSlice(h, "matchConditions")
	var all []string
	for _, c := range conds {
		all = append(all, c.(map[string]any)["expression"].(string))
	}
	joined := strings.Join(all, " && ")
	for _, want := range []string{"oldObject == null || !has(oldObject.metadata.deletionTimestamp)", "'nodes'", "'leases'", "'certificatesigningrequests'", "system:nodes"} {
		if !strings.Contains(joined, want) {
			t.Errorf("matchConditions lack %s: %s", want, joined)
		}
	}
	rules, _, _ := unstructured.NestedSlice(h, "rules")
	for _, r := range rules {
		ops := toStrings(r.(map[string]any)["operations"])
		if strings.Join(ops, ",") != "CREATE,UPDATE" {
			t.Errorf("rule operations %v", ops)
		}
		for _, res := range toStrings(r.(map[string]any)["resources"]) {
			if strings.HasSuffix(res, "/status") || res == "*" {
				t.Errorf("rule matches %s", res)
			}
		}
	}
	canary := w.ValidatingWebhookConfiguration([]byte("CA"), true)
	cexpr, _, _ := unstructured.NestedSlice(canary.Object, "webhooks")
	csel, _, _ := unstructured.NestedSlice(cexpr[0].(map[string]any), "namespaceSelector", "matchExpressions")
	if csel[0].(map[string]any)["operator"] != "In" || toStrings(csel[0].(map[string]any)["values"])[0] != WebhookCanaryNamespace {
		t.Fatalf("canary stage selector = %v", csel)
	}
}

func toStrings(v any) []string {
	var out []string
	for _, s := range v.([]any) {
		out = append(out, s.(string))
	}
	return out
}

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

// TestProbe is B6 against the real handler over real TLS: the right CA passes, a foreign CA is the
// x509 category, a policy that allows the denied canary is the wrong-response category.
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
	if err := w.probeAll(context.Background(), otherCA, []string{addr}); !errors.Is(err, ErrWebhookTLSMismatch) {
		t.Fatalf("probe with a foreign CA = %v, want ErrWebhookTLSMismatch", err)
	}
	permissive := serveWebhook(t, secret, "rules: [{name: all, registries: [canary.invalid, registry.k8s.io]}]")
	if err := w.probeAll(context.Background(), caPEM, []string{permissive}); !errors.Is(err, ErrWebhookWrongResponse) {
		t.Fatalf("probe of a webhook that allows the canary = %v, want ErrWebhookWrongResponse", err)
	}
	// Nothing listening: not a TLS problem, an endpoint problem.
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	dead := l.Addr().String()
	l.Close()
	if err := w.probeAll(context.Background(), caPEM, []string{dead}); !errors.Is(err, ErrWebhookNoReadyEndpoints) {
		t.Fatalf("probe of a closed port = %v, want ErrWebhookNoReadyEndpoints", err)
	}
	var we *WebhookError
	if !errors.As(w.probeAll(context.Background(), otherCA, []string{addr}), &we) || we.Hint == "" {
		t.Fatal("failure without a hint")
	}
}

func TestInstallRefusesBadInput(t *testing.T) {
	w := NewWebhookInstaller(WebhookConfig{}, fake.NewSimpleClientset(), nil, io.Discard)
	if _, err := w.Install(context.Background()); !errors.Is(err, ErrWebhookInvalidConfiguration) {
		t.Fatalf("Install without image = %v", err)
	}
	w = NewWebhookInstaller(WebhookConfig{Image: "x", Policy: []byte("rules: 1")}, fake.NewSimpleClientset(), nil, io.Discard)
	if _, err := w.Install(context.Background()); !errors.Is(err, ErrWebhookInvalidConfiguration) {
		t.Fatalf("Install with a bad policy = %v", err)
	}
}
