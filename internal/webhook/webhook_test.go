package webhook

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	admissionv1 "k8s.io/api/admission/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/loadchart"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestPolicyCheck(t *testing.T) {
	p, err := ParsePolicy([]byte(DefaultPolicy + "- name: pinned\n  registries: [\"pinned.example:5000\"]\n  requireDigest: true\n"))
	if err != nil {
		t.Fatal(err)
	}
	digest := strings.Repeat("a", 64)
	for _, tc := range []struct {
		image   string
		allowed bool
		rule    string
	}{
		{"registry.k8s.io/pause:3.10.1", true, "kubernetes-images"},
		{"berth.local/testapp:v1", true, "berth-images"},
		{"evil.example/x:1", false, DefaultRuleName},
		{"busybox", false, DefaultRuleName},
		{"library/busybox:1", false, DefaultRuleName},
		{"pinned.example:5000/a/b:1", false, "pinned"},
		{"pinned.example:5000/a/b@sha256:" + digest, true, "pinned"},
	} {
		v := p.Check(tc.image)
		if v.Allowed != tc.allowed || v.Rule != tc.rule {
			t.Errorf("Check(%q) = %+v, want allowed=%v rule=%s", tc.image, v, tc.allowed, tc.rule)
		}
	}
}

func TestParsePolicyRejects(t *testing.T) {
	for _, doc := range []string{
		"rules: [{name: Bad, registries: [a.b]}]",
		"rules: [{name: a, registries: []}]",
		"rules: [{name: a, registries: [a.b/c]}]",
		"rules: [{name: a, registries: [a.b]}, {name: a, registries: [c.d]}]",
		"rules: [{name: default-deny, registries: [a.b]}]",
		"rules: [{name: a, registries: [a.b], unknown: 1}]",
	} {
		if _, err := ParsePolicy([]byte(doc)); !errors.Is(err, ErrInvalidPolicy) {
			t.Errorf("ParsePolicy(%q) = %v, want ErrInvalidPolicy", doc, err)
		}
	}
}

func review(op admissionv1.Operation, ns, kind, sub string, obj, old string) []byte {
	r := map[string]any{
		"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
		"request": map[string]any{
			"uid": "uid-1", "operation": string(op), "namespace": ns, "subResource": sub,
			"kind":     map[string]any{"group": "", "version": "v1", "kind": kind},
			"resource": map[string]any{"group": "", "version": "v1", "resource": strings.ToLower(kind) + "s"},
			"name":     "x", "userInfo": map[string]any{"username": "u"},
		},
	}
	req := r["request"].(map[string]any)
	if obj != "" {
		req["object"] = json.RawMessage(obj)
	}
	if old != "" {
		req["oldObject"] = json.RawMessage(old)
	}
	b, _ := json.Marshal(r)
	return b
}

func pod(image string, deleting bool) string {
	meta := `{"name":"x"}`
	if deleting {
		meta = `{"name":"x","deletionTimestamp":"2026-11-21T00:00:00Z"}`
	}
	return fmt.Sprintf(`{"apiVersion":"v1","kind":"Pod","metadata":%s,"spec":{"containers":[{"name":"c","image":%q}]}}`, meta, image)
}

func call(t testing.TB, h http.Handler, body []byte) (int, *admissionv1.AdmissionResponse) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(body)))
	if rec.Code != http.StatusOK {
		return rec.Code, nil
	}
	var out admissionv1.AdmissionReview
	if err := json.Unmarshal(rec.Body.Bytes(), &out); err != nil {
		t.Fatal(err)
	}
	if out.Response == nil || out.Response.UID != "uid-1" || out.APIVersion != "admission.k8s.io/v1" || out.Kind != "AdmissionReview" {
		t.Fatalf("response does not echo UID and apiVersion: %s", rec.Body.String())
	}
	return rec.Code, out.Response
}

func loadedHandler(t testing.TB) *Handler {
	h := NewHandler(zap.NewNop(), []string{"kube-system", "berth-system"}, time.Second, NewMetrics())
	p, err := ParsePolicy([]byte(DefaultPolicy))
	if err != nil {
		t.Fatal(err)
	}
	h.SetPolicy(p)
	return h
}

func TestHandlerDecisions(t *testing.T) {
	h := loadedHandler(t)
	bad, good := pod("evil.example/x:1", false), pod("berth.local/testapp:v1", false)
	deployment := `{"kind":"Deployment","spec":{"template":{"spec":{"initContainers":[{"name":"i","image":"evil.example/i"}],"containers":[{"name":"c","image":"berth.local/a"}]}}}}`
	cronjob := `{"kind":"CronJob","spec":{"jobTemplate":{"spec":{"template":{"spec":{"containers":[{"name":"c","image":"evil.example/c"}]}}}}}}`
	for _, tc := range []struct {
		name    string
		body    []byte
		allowed bool
		rule    string
	}{
		{"disallowed pod", review(admissionv1.Create, "default", "Pod", "", bad, ""), false, DefaultRuleName},
		{"allowed pod", review(admissionv1.Create, "default", "Pod", "", good, ""), true, "berth-images"},
		{"kube-system", review(admissionv1.Create, "kube-system", "Pod", "", bad, ""), true, RuleExemptNamespace},
		{"own namespace", review(admissionv1.Create, "berth-system", "Pod", "", bad, ""), true, RuleExemptNamespace},
		{"delete", review(admissionv1.Delete, "default", "Pod", "", "", bad), true, RuleExemptOperation},
		{"finalizer removal", review(admissionv1.Update, "default", "Pod", "", pod("evil.example/x:1", true), pod("evil.example/x:1", true)), true, RuleTerminating},
		{"update not terminating", review(admissionv1.Update, "default", "Pod", "", bad, bad), false, DefaultRuleName},
		{"create with deletionTimestamp gets no bypass", review(admissionv1.Create, "default", "Pod", "", pod("evil.example/x:1", true), ""), false, DefaultRuleName},
		{"status", review(admissionv1.Update, "default", "Pod", "status", bad, bad), true, RuleSubresource},
		{"ephemeral containers", review(admissionv1.Update, "default", "Pod", "ephemeralcontainers", bad, good), false, DefaultRuleName},
		{"deployment init container", review(admissionv1.Create, "default", "Deployment", "", deployment, ""), false, DefaultRuleName},
		{"cronjob", review(admissionv1.Create, "default", "CronJob", "", cronjob, ""), false, DefaultRuleName},
		{"configmap", review(admissionv1.Create, "default", "ConfigMap", "", `{"data":{}}`, ""), true, RuleUnhandledKind},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, resp := call(t, h, tc.body)
			if code != http.StatusOK {
				t.Fatalf("HTTP %d", code)
			}
			if resp.Allowed != tc.allowed || resp.AuditAnnotations["rule"] != tc.rule {
				t.Fatalf("allowed=%v rule=%s (%v), want allowed=%v rule=%s", resp.Allowed, resp.AuditAnnotations["rule"], resp.Result, tc.allowed, tc.rule)
			}
			if !tc.allowed && !strings.Contains(resp.Result.Message, fmt.Sprintf("rule %q", tc.rule)) {
				t.Fatalf("deny message %q does not name rule %s", resp.Result.Message, tc.rule)
			}
		})
	}
}

func TestHandlerWithoutPolicyDenies(t *testing.T) {
	h := NewHandler(zap.NewNop(), []string{"kube-system"}, time.Second, nil)
	_, resp := call(t, h, review(admissionv1.Create, "default", "Pod", "", pod("berth.local/a", false), ""))
	if resp.Allowed || resp.AuditAnnotations["rule"] != RuleNotReady || !strings.Contains(resp.Result.Message, "retry") {
		t.Fatalf("response before policy load = %+v, want a retryable denial", resp)
	}
	_, resp = call(t, h, review(admissionv1.Create, "kube-system", "Pod", "", pod("evil.example/a", false), ""))
	if !resp.Allowed {
		t.Fatal("kube-system denied before policy load")
	}
}

func TestHandlerMalformed(t *testing.T) {
	h := loadedHandler(t)
	for _, body := range [][]byte{[]byte("{"), []byte(`{"apiVersion":"admission.k8s.io/v1"}`), bytes.Repeat([]byte(" "), MaxReviewBytes+1)} {
		if code, _ := call(t, h, body); code != http.StatusBadRequest {
			t.Errorf("malformed review: HTTP %d, want 400", code)
		}
	}
	_, resp := call(t, h, review(admissionv1.Create, "default", "Pod", "", `"not an object"`, ""))
	if resp.Allowed {
		t.Fatal("unreadable pod allowed")
	}
}

// keyPair writes a fresh self-signed serving keypair for localhost into dir.
func keyPair(t testing.TB, dir string) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: "berth-webhook"},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalECPrivateKey(key)
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	// Key first, then certificate: a reader in between sees a mismatched pair and keeps the old one.
	if err := os.WriteFile(filepath.Join(dir, "tls.key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tls.crt"), certPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	return der
}

type running struct {
	s      *Server
	addr   string
	probe  string
	cancel context.CancelFunc
	done   chan error
	dir    string
	// logs are the server's log entries.
	logs *observer.ObservedLogs
}

func startServer(t testing.TB, delay time.Duration, writePolicy bool) *running {
	t.Helper()
	if delay == 0 {
		delay = time.Millisecond
	}
	dir := t.TempDir()
	keyPair(t, dir)
	if writePolicy {
		if err := os.WriteFile(filepath.Join(dir, "policy.yaml"), []byte(DefaultPolicy), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	core, logs := observer.New(zap.InfoLevel)
	s := New(Config{
		CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"), PolicyFile: filepath.Join(dir, "policy.yaml"),
		ReloadInterval: 20 * time.Millisecond, ShutdownDelay: delay, ShutdownTimeout: 2 * time.Second, HandlerDeadline: time.Second,
		ExemptNamespaces: []string{"kube-system"},
	}, zap.New(core))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{s: s, addr: ln.Addr().String(), probe: pln.Addr().String(), cancel: cancel, done: make(chan error, 1), dir: dir, logs: logs}
	go func() { r.done <- s.Serve(ctx, ln, pln) }()
	t.Cleanup(func() {
		cancel()
		<-r.done
	})
	return r
}

func (r *running) readyz(t testing.TB) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + r.probe + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func waitFor(t testing.TB, what string, f func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(t.Context(), 10*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		return f(), nil
	})
	if err != nil {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// TestReadinessGating: readiness needs the policy, the loaded certificate on the wire, and no drain.
func TestReadinessGating(t *testing.T) {
	r := startServer(t, 0, false)
	if code, body := r.readyz(t); code != http.StatusServiceUnavailable || !strings.Contains(body, ErrNoPolicy.Error()) {
		t.Fatalf("readyz without policy = %d %q", code, body)
	}
	if err := os.WriteFile(filepath.Join(r.dir, "policy.yaml"), []byte(DefaultPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "ready after the policy appeared", func() bool { c, _ := r.readyz(t); return c == http.StatusOK })

	// A listener serving another certificate (say, a stale process on the port) is not ready.
	other := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {}))
	defer other.Close()
	r.s.setSelfAddr(other.Listener.Addr())
	if err := r.s.CheckReady(context.Background()); !errors.Is(err, ErrCertMismatch) {
		t.Fatalf("CheckReady against a foreign certificate = %v, want ErrCertMismatch", err)
	}
	addr, _ := net.ResolveTCPAddr("tcp", r.addr)
	r.s.setSelfAddr(addr)
	if err := r.s.CheckReady(context.Background()); err != nil {
		t.Fatalf("CheckReady = %v", err)
	}
}

// TestBadPolicyKeepsTheLoadedOne: a policy file that stops parsing leaves the loaded policy in force.
func TestBadPolicyKeepsTheLoadedOne(t *testing.T) {
	r := startServer(t, 0, true)
	waitFor(t, "ready", func() bool { c, _ := r.readyz(t); return c == http.StatusOK })
	if err := os.WriteFile(filepath.Join(r.dir, "policy.yaml"), []byte("rules: [{name: BAD}]"), 0o600); err != nil {
		t.Fatal(err)
	}
	// The reload loop (every 20 ms here) sees the bad file and reports it once; later rounds are quiet.
	waitFor(t, "the reload loop to report the bad policy", func() bool {
		return r.logs.FilterMessage("reloading files failed, keeping the loaded versions").Len() > 0
	})
	if err := r.s.Reload(); err != nil {
		t.Fatalf("Reload of an already reported bad policy = %v", err)
	}
	_, resp := call(t, r.s.Handler(), review(admissionv1.Create, "default", "Pod", "", pod("berth.local/a", false), ""))
	if !resp.Allowed {
		t.Fatal("the loaded policy was dropped")
	}
	if c, _ := r.readyz(t); c != http.StatusOK {
		t.Fatal("not ready after a bad policy update")
	}
}

// TestRotationWithoutRestart: a new keypair on disk is served without a restart and readiness follows it.
func TestRotationWithoutRestart(t *testing.T) {
	r := startServer(t, 0, true)
	waitFor(t, "ready", func() bool { c, _ := r.readyz(t); return c == http.StatusOK })
	served := func() []byte {
		conn, err := tls.Dial("tcp", r.addr, &tls.Config{InsecureSkipVerify: true})
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].Raw
	}
	want := keyPair(t, r.dir)
	waitFor(t, "the new certificate on the wire", func() bool { return bytes.Equal(served(), want) })
	if c, body := r.readyz(t); c != http.StatusOK {
		t.Fatalf("readyz after rotation = %d %q", c, body)
	}
}

// TestDrain is the drain on SIGTERM: readiness fails at once, requests keep being served with
// Connection: close during the delay, in-flight work completes, then the server stops.
func TestDrain(t *testing.T) {
	const delay = 300 * time.Millisecond
	r := startServer(t, delay, true)
	waitFor(t, "ready", func() bool { c, _ := r.readyz(t); return c == http.StatusOK })
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	defer client.CloseIdleConnections()
	post := func() (*http.Response, error) {
		return client.Post("https://"+r.addr+Path, "application/json", bytes.NewReader(review(admissionv1.Create, "default", "Pod", "", pod("berth.local/a", false), "")))
	}
	resp, err := post()
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.Close {
		t.Fatal("Connection: close before the drain")
	}
	stopped := time.Now()
	r.cancel()
	// Serve sees the stop request on its own goroutine: readiness fails once it has.
	last := 0
	if err := wait.PollUntilContextTimeout(t.Context(), 10*time.Millisecond, 5*time.Second, true, func(context.Context) (bool, error) {
		last, _ = r.readyz(t)
		return last == http.StatusServiceUnavailable, nil
	}); err != nil {
		t.Fatalf("readyz after the stop request = %d, want %d", last, http.StatusServiceUnavailable)
	}
	served := 0
	for time.Since(stopped) < delay/2 {
		resp, err := post()
		if err != nil {
			t.Fatalf("request during the drain delay failed: %v", err)
		}
		resp.Body.Close()
		if !resp.Close {
			t.Fatal("response during the drain has no Connection: close")
		}
		served++
	}
	if err := <-r.done; err != nil {
		t.Fatal(err)
	}
	r.done <- nil // for the cleanup
	if lived := time.Since(stopped); lived < delay {
		t.Fatalf("server stopped %s after the stop request, before the %s delay", lived, delay)
	}
	t.Logf("served %d requests during the drain", served)
}

// BenchmarkAdmission measures decision latency over real TLS on loopback at a fixed rate (default
// 500 req/s, BERTH_BENCH_RATE overrides) and reports p50/p99/max; b.N is the number of requests.
func BenchmarkAdmission(b *testing.B) {
	r := startServer(b, 0, true)
	waitFor(b, "ready", func() bool { c, _ := r.readyz(b); return c == http.StatusOK })
	rate := 500
	if v := os.Getenv("BERTH_BENCH_RATE"); v != "" {
		fmt.Sscan(v, &rate)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, MaxIdleConnsPerHost: 64}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	bodies := [][]byte{
		review(admissionv1.Create, "default", "Pod", "", pod("berth.local/a:1", false), ""),
		review(admissionv1.Create, "default", "Pod", "", pod("evil.example/a:1", false), ""),
	}
	var mu sync.Mutex
	lat := make([]time.Duration, 0, b.N)
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	b.ResetTimer()
	chart, err := loadchart.NewRecorder(time.Now(), time.Second)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < b.N; i++ {
		<-tick.C
		wg.Add(1)
		go func(body []byte) {
			defer wg.Done()
			start := time.Now()
			resp, err := client.Post("https://"+r.addr+Path, "application/json", bytes.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			d := time.Since(start)
			chart.Add(start, d)
			mu.Lock()
			lat = append(lat, d)
			mu.Unlock()
		}(bodies[i%2])
	}
	chart.Stop(time.Now()) // the last request started
	wg.Wait()
	b.StopTimer()
	writeBenchChart(b, fmt.Sprintf("make bench-webhook: the webhook alone over TLS on loopback, %d req/s", rate),
		loadchart.Series{Name: "admission reviews", Points: chart.Points()})
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	if len(lat) == 0 {
		return
	}
	q := func(p float64) time.Duration { return lat[int(p*float64(len(lat)-1))] }
	b.ReportMetric(float64(q(0.5).Microseconds()), "p50-us")
	b.ReportMetric(float64(q(0.99).Microseconds()), "p99-us")
	b.ReportMetric(float64(slices.Max(lat).Microseconds()), "max-us")
	b.ReportMetric(float64(rate), "req/s")
}

// writeBenchChart draws the series (requests per second, p50 and p99 latency by second) into the
// PNG file BERTH_BENCH_CHART names, if it names one; each run of the benchmark overwrites it, so
// the last (largest b.N) stays.
func writeBenchChart(b *testing.B, title string, series ...loadchart.Series) {
	path := os.Getenv("BERTH_BENCH_CHART")
	if path == "" {
		return
	}
	if err := loadchart.WritePNG(path, title, series...); err != nil {
		b.Fatal(err)
	}
	b.Logf("chart: %s", path)
}

// BenchmarkDecide measures the handler alone (no network).
func BenchmarkDecide(b *testing.B) {
	h := loadedHandler(b)
	body := review(admissionv1.Create, "default", "Pod", "", pod("berth.local/a:1", false), "")
	for b.Loop() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(body)))
	}
}
