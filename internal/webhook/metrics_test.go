package webhook

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	admissionv1 "k8s.io/api/admission/v1"

	"github.com/berth-k8s/berth/internal/version"
)

// scrape parses the server's /metrics.
func (r *running) scrape(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + r.probe + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	return fams
}

// value is the value of the series of family name whose labels include want; ok is false if none.
func value(fams map[string]*dto.MetricFamily, name string, want map[string]string) (v float64, ok bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for k, w := range want {
			if have[k] != w {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

func TestMetrics(t *testing.T) {
	r := startServer(t, 0, false)
	// No policy: not ready, and the gauge says so once /readyz ran.
	r.readyz(t)
	fams := r.scrape(t)
	if v, ok := value(fams, "berth_webhook_ready", nil); !ok || v != 0 {
		t.Fatalf("berth_webhook_ready without a policy = %v (present %v), want 0", v, ok)
	}
	if _, ok := value(fams, "berth_webhook_decisions_total", nil); ok {
		t.Fatal("decisions counted before any request")
	}
	if v, ok := value(fams, "berth_build_info", map[string]string{"version": version.Version, "commit": version.Commit()}); !ok || v != 1 {
		t.Fatalf("berth_build_info = %v (present %v), want 1", v, ok)
	}
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes"} {
		if fams[name] == nil {
			t.Errorf("%s not exported", name)
		}
	}
	pemCert, err := readCert(r.dir)
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := value(fams, "berth_webhook_cert_expiry_timestamp_seconds", nil); v != float64(pemCert.NotAfter.Unix()) {
		t.Fatalf("berth_webhook_cert_expiry_timestamp_seconds = %v, want %d", v, pemCert.NotAfter.Unix())
	}

	if err := os.WriteFile(filepath.Join(r.dir, "policy.yaml"), []byte(DefaultPolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "ready", func() bool { c, _ := r.readyz(t); return c == http.StatusOK })
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	defer client.CloseIdleConnections()
	for _, body := range [][]byte{
		review(admissionv1.Create, "default", "Pod", "", pod("evil.example/x:1", false), ""),
		review(admissionv1.Create, "default", "Pod", "", pod("evil.example/y:1", false), ""),
		review(admissionv1.Create, "default", "Pod", "", pod("berth.local/testapp:v1", false), ""),
	} {
		resp, err := client.Post("https://"+r.addr+Path, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	fams = r.scrape(t)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"berth_webhook_decisions_total", map[string]string{"decision": "deny", "rule": DefaultRuleName}, 2},
		{"berth_webhook_decisions_total", map[string]string{"decision": "allow", "rule": "berth-images"}, 1},
		{"berth_webhook_decision_seconds", nil, 3},
		{"berth_webhook_ready", nil, 1},
	} {
		if v, ok := value(fams, c.name, c.labels); !ok || v != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, v, ok, c.want)
		}
	}
	if _, ok := value(fams, "berth_webhook_decisions_total", map[string]string{"decision": "allow", "rule": DefaultRuleName}); ok {
		t.Error("an allow by default-deny was counted")
	}
}

func readCert(dir string) (*x509.Certificate, error) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	if err != nil {
		return nil, err
	}
	return x509.ParseCertificate(cert.Certificate[0])
}
