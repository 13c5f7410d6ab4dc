package mini

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"go.uber.org/zap/zaptest"
)

// fakeAPIServer is a TLS server that answers /readyz with 200 while ready is set (else 500) and
// names itself on every other path.
type fakeAPIServer struct {
	*httptest.Server
	ready atomic.Bool
}

func newFakeAPIServer(t *testing.T, name string, tlsCfg *tls.Config) *fakeAPIServer {
	t.Helper()
	f := &fakeAPIServer{}
	f.ready.Store(true)
	f.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/readyz" {
			if !f.ready.Load() {
				http.Error(w, "etcd not ready", http.StatusInternalServerError)
				return
			}
			_, _ = io.WriteString(w, "ok")
			return
		}
		_, _ = io.WriteString(w, name)
	}))
	if tlsCfg != nil {
		f.TLS = tlsCfg
	}
	f.StartTLS()
	t.Cleanup(f.Close)
	return f
}

// TestAPIBalancer: connections go to a ready backend only; when the ready one goes away and another
// becomes ready, new connections follow within one health check; with no health known yet, a
// backend that refuses connections is skipped.
func TestAPIBalancer(t *testing.T) {
	a := newFakeAPIServer(t, "a", nil)
	// b serves with a's certificate, so the client below trusts both (as one cluster CA does).
	b := newFakeAPIServer(t, "b", a.TLS)
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := closed.Addr().String()
	closed.Close()

	bal := newAPIBalancer(zaptest.NewLogger(t))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- bal.serve(ctx, lis) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	client := a.Client() // trusts the certificate every backend serves
	get := func() string {
		t.Helper()
		tr := client.Transport.(*http.Transport).Clone()
		tr.DisableKeepAlives = true
		resp, err := (&http.Client{Transport: tr}).Get("https://" + lis.Addr().String() + "/version")
		if err != nil {
			t.Fatalf("GET through the balancer: %v", err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return string(body)
	}

	// Health unknown: the dead backend is tried and skipped.
	bal.setBackends([]string{deadAddr, a.Listener.Addr().String()})
	for range 3 {
		if got := get(); got != "a" {
			t.Fatalf("with health unknown, got backend %q, want a", got)
		}
	}

	bal.setBackends([]string{a.Listener.Addr().String(), b.Listener.Addr().String()})
	b.ready.Store(false)
	bal.checkOnce(ctx)
	for range 4 {
		if got := get(); got != "a" {
			t.Fatalf("b is not ready, yet a connection went to %q", got)
		}
	}

	// a goes away (a powered-off control plane), b becomes ready.
	a.Close()
	b.ready.Store(true)
	bal.checkOnce(ctx)
	for range 4 {
		if got := get(); got != "b" {
			t.Fatalf("after a went away, got backend %q, want b", got)
		}
	}
}

// TestBackendReady: a backend is ready only while its /readyz answers 200.
func TestBackendReady(t *testing.T) {
	a := newFakeAPIServer(t, "a", nil)
	ctx := context.Background()
	if err := backendReady(ctx, a.Listener.Addr().String()); err != nil {
		t.Fatalf("ready backend: %v", err)
	}
	a.ready.Store(false)
	if err := backendReady(ctx, a.Listener.Addr().String()); !errors.Is(err, errNotReady) {
		t.Fatalf("a backend whose /readyz fails: %v, want errNotReady", err)
	}
	a.Close()
	if err := backendReady(ctx, a.Listener.Addr().String()); err == nil {
		t.Fatal("a backend that is gone counted as ready")
	}
}
