package certkeeper

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/berth-k8s/berth/internal/webhook/install"
)

func writeCert(t *testing.T, path string, notAfter time.Time) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: filepath.Base(path)}, NotBefore: notAfter.Add(-time.Hour), NotAfter: notAfter}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestExpiryMetrics: the control-plane certificates are read at every scrape (a renewal shows at
// the next one), a missing or broken one is counted as unreadable, and the leader's webhook
// expiries share the metric; they go when the term ends.
func TestExpiryMetrics(t *testing.T) {
	dir := t.TempDir()
	base := time.Unix(1_900_000_000, 0)
	for name, rel := range ControlPlaneFiles {
		if name == "etcd-peer" {
			continue // missing
		}
		writeCert(t, filepath.Join(dir, rel), base)
	}
	if err := os.WriteFile(filepath.Join(dir, ControlPlaneFiles["front-proxy-client"]), []byte("not a certificate"), 0o644); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	m := NewMetrics(reg, NewControlPlaneCerts(dir))
	m.Leading(true)
	m.Pass(install.KeepReport{ConfigOK: true, LeafRenewed: true, Expiry: install.Expiry{Leaf: base.Add(time.Hour), CA: base.Add(2 * time.Hour), Bundle: base.Add(2 * time.Hour)}}, nil, time.Second)

	check := func(apiserver time.Time) {
		t.Helper()
		got := map[string]float64{}
		fams, err := reg.Gather()
		if err != nil {
			t.Fatalf("gathering (both collectors of %s): %v", ExpiryMetric, err)
		}
		for _, f := range fams {
			if f.GetName() != ExpiryMetric {
				continue
			}
			for _, mt := range f.GetMetric() {
				var scope, cert string
				for _, l := range mt.GetLabel() {
					switch l.GetName() {
					case "scope":
						scope = l.GetValue()
					case "cert":
						cert = l.GetValue()
					}
				}
				got[scope+"/"+cert] = mt.GetGauge().GetValue()
			}
		}
		if n := gaugeValue(fams, "berth_certkeeper_unreadable_certs"); n != 2 {
			t.Errorf("berth_certkeeper_unreadable_certs = %v, want 2 (one missing, one broken)", n)
		}
		if len(got) != len(ControlPlaneFiles)-2+3 {
			t.Fatalf("%d expiry series, want %d: %v", len(got), len(ControlPlaneFiles)-2+3, got)
		}
		if got["control-plane/apiserver"] != float64(apiserver.Unix()) || got["control-plane/etcd-ca"] != float64(base.Unix()) ||
			got["webhook/serving"] != float64(base.Add(time.Hour).Unix()) || got["webhook/bundle"] != float64(base.Add(2*time.Hour).Unix()) {
			t.Fatalf("expiry series %v", got)
		}
	}
	check(base)
	renewed := base.Add(365 * 24 * time.Hour)
	writeCert(t, filepath.Join(dir, ControlPlaneFiles["apiserver"]), renewed)
	check(renewed)

	if got := testutil.ToFloat64(m.configOK.WithLabelValues()); got != 1 {
		t.Errorf("berth_webhook_config_ok = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.renewals.WithLabelValues("leaf")); got != 1 {
		t.Errorf("leaf renewals = %v, want 1", got)
	}
	m.Pass(install.KeepReport{}, install.ErrConfigMissing, time.Second)
	if got := testutil.ToFloat64(m.configOK.WithLabelValues()); got != 0 {
		t.Errorf("berth_webhook_config_ok = %v after ErrConfigMissing, want 0", got)
	}
	if got := testutil.ToFloat64(m.checks.WithLabelValues("config-missing")); got != 1 {
		t.Errorf("config-missing checks = %v, want 1", got)
	}
	m.Pass(install.KeepReport{}, errors.Join(install.ErrTLSMismatch), time.Second)
	if got := testutil.ToFloat64(m.checks.WithLabelValues("failed")); got != 1 {
		t.Errorf("failed checks = %v, want 1", got)
	}

	m.Leading(false)
	if n := testutil.CollectAndCount(m.expiry); n != 0 {
		t.Errorf("%d webhook expiry series after the term, want none", n)
	}
	if n := testutil.CollectAndCount(m.configOK); n != 0 {
		t.Errorf("berth_webhook_config_ok still exported after the term")
	}
}

func gaugeValue(fams []*dto.MetricFamily, name string) float64 {
	for _, f := range fams {
		if f.GetName() == name && len(f.GetMetric()) == 1 {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	return -1
}
