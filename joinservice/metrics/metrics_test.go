package metrics

import (
	"context"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/version"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestServeExposesJoinMetrics(t *testing.T) {
	m := New(counts{7, 9})
	m.Attempt("join", "rejected", "MEASUREMENT_MISMATCH")
	m.Attempt("join", "accepted", "")
	m.Latency("join", "total", 3*time.Millisecond)
	m.InFlight(1)
	m.InFlight(1)
	m.InFlight(-1)
	m.PolicyReload(false)
	m.AttestationOperation(PurposeSession, OperationQuote)
	m.AttestationOperation(PurposeSession, OperationQuote)
	m.AttestationOperation(PurposeConnection, OperationActivate)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, lis, nil, zap.NewNop()) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + lis.Addr().String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`berth_joinservice_attempts_total{outcome="rejected",reason="MEASUREMENT_MISMATCH",rpc="join"} 1`,
		`berth_joinservice_attempts_total{outcome="accepted",reason="",rpc="join"} 1`,
		`berth_joinservice_duration_seconds_bucket{rpc="join",stage="total",le="0.005"} 1`,
		`berth_joinservice_in_flight 1`,
		`berth_joinservice_ledger_dropped_total 7`,
		`berth_joinservice_ledger_superseded_total 9`,
		`berth_joinservice_policy_reloads_total{result="rejected"} 1`,
		`berth_joinservice_attestation_operations_total{operation="quote",purpose="session"} 2`,
		`berth_joinservice_attestation_operations_total{operation="activation",purpose="connection"} 1`,
		`berth_joinservice_attestation_operations_total{operation="quote",purpose="connection"} 0`,
		`go_goroutines`,
		`berth_build_info{commit="` + version.Commit() + `",go_version="` + runtime.Version() + `",version="` + version.Version + `"} 1`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

type counts struct{ dropped, superseded uint64 }

func (c counts) Dropped() uint64    { return c.dropped }
func (c counts) Superseded() uint64 { return c.superseded }

// TestServeRoutesProbes: /livez and /readyz go to the probes handler when there is one, and are not
// served without one.
func TestServeRoutesProbes(t *testing.T) {
	for _, withProbes := range []bool{true, false} {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var probes http.Handler
		if withProbes {
			probes = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("probe " + r.URL.Path)) })
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- New(nil).Serve(ctx, lis, probes, zap.NewNop()) }()
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
		for _, path := range []string{"/livez", "/readyz"} {
			resp, err := client.Get("http://" + lis.Addr().String() + path)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if withProbes && (resp.StatusCode != http.StatusOK || string(body) != "probe "+path) {
				t.Errorf("%s with probes = %d %q", path, resp.StatusCode, body)
			}
			if !withProbes && resp.StatusCode != http.StatusNotFound {
				t.Errorf("%s without probes = %d, want 404", path, resp.StatusCode)
			}
		}
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
}
