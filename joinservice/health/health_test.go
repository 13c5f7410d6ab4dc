package health

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func get(t *testing.T, p *Probes, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	p.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	body, _ := io.ReadAll(rec.Result().Body)
	return rec.Code, string(body)
}

func TestReadiness(t *testing.T) {
	p := New("cluster-secrets", "join-server")
	if code, body := get(t, p, "/readyz"); code != http.StatusServiceUnavailable ||
		!strings.Contains(body, "[-]cluster-secrets: not checked yet") || !strings.Contains(body, "[-]join-server: not checked yet") {
		t.Fatalf("/readyz before any check = %d %q, want 503 naming both conditions", code, body)
	}
	p.Set("cluster-secrets", errors.New("reading cluster secrets: forbidden\nsecond line"))
	p.Set("join-server", nil)
	code, body := get(t, p, "/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "[-]cluster-secrets: reading cluster secrets: forbidden second line\n") ||
		strings.Contains(body, "join-server") {
		t.Fatalf("/readyz with the secrets failing = %d %q, want 503 naming only the secrets on one line", code, body)
	}
	if err := p.Ready(); err == nil || !strings.Contains(err.Error(), "cluster-secrets") {
		t.Fatalf("Ready() = %v, want the failing condition", err)
	}
	p.Set("cluster-secrets", nil)
	if code, body := get(t, p, "/readyz"); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("/readyz with every condition met = %d %q, want 200 ok", code, body)
	}
	if code, body := get(t, p, "/readyz?verbose"); code != http.StatusOK || !strings.Contains(body, "[+]cluster-secrets ok") {
		t.Fatalf("/readyz?verbose = %d %q, want the checks listed", code, body)
	}
	p.Stopping()
	if code, body := get(t, p, "/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "stopping") {
		t.Fatalf("/readyz while stopping = %d %q, want 503", code, body)
	}
	if p.Ready() == nil {
		t.Fatal("Ready() while stopping = nil")
	}
}

func TestLiveness(t *testing.T) {
	p := New("x")
	if code, _ := get(t, p, "/livez"); code != http.StatusOK {
		t.Fatalf("/livez before any loop started = %d, want 200 (nothing has died)", code)
	}
	ledgerEnded := p.Started("ledger")
	watchEnded := p.Started("policy-watch")
	if code, _ := get(t, p, "/livez"); code != http.StatusOK || p.Live() != nil {
		t.Fatalf("/livez with the loops running = %d, want 200", code)
	}
	watchEnded(errors.New("watching join configuration: boom"))
	code, body := get(t, p, "/livez")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "[-]loop policy-watch: ended: watching join configuration: boom") || strings.Contains(body, "ledger") {
		t.Fatalf("/livez with a dead loop = %d %q, want 503 naming it", code, body)
	}
	if err := p.Live(); err == nil || !strings.Contains(err.Error(), "policy-watch") {
		t.Fatalf("Live() = %v, want the dead loop", err)
	}
	// A loop started again (a restart of the part) is alive again.
	_ = p.Started("policy-watch")
	if code, _ := get(t, p, "/livez"); code != http.StatusOK {
		t.Fatalf("/livez after the loop restarted = %d", code)
	}
	// While stopping, loops end without failing liveness.
	p.Stopping()
	ledgerEnded(nil)
	if code, _ := get(t, p, "/livez"); code != http.StatusOK {
		t.Fatalf("/livez with a loop ended while stopping = %d, want 200", code)
	}
}

func TestUnknownPath(t *testing.T) {
	if code, _ := get(t, New(), "/healthz"); code != http.StatusNotFound {
		t.Fatalf("/healthz = %d, want 404", code)
	}
}
