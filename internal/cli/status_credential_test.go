package cli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"errors"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
)

func adminCertPEM(t *testing.T, notBefore, notAfter time.Time) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(7),
		Subject:      pkix.Name{CommonName: "berth-admin", Organization: []string{"kubeadm:cluster-admins"}},
		NotBefore:    notBefore, NotAfter: notAfter,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// TestOperatorCredentialWarnsBeforeItEnds: status warns once less than a quarter of the
// credential's validity, at most a week, is left, and refuses to go on with an expired one, naming
// berth kubeconfig.
func TestOperatorCredentialWarnsBeforeItEnds(t *testing.T) {
	now := time.Now().Truncate(time.Second)
	day, year := 24*time.Hour, 365*24*time.Hour
	for _, tc := range []struct {
		name          string
		from, to      time.Time
		soon, expired bool
	}{
		{"a day's credential with 7h left", now.Add(-17 * time.Hour), now.Add(7 * time.Hour), false, false},
		{"a day's credential with 5h left", now.Add(-19 * time.Hour), now.Add(5 * time.Hour), true, false},
		{"a year's admin.conf with 30 days left", now.Add(-year + 30*day), now.Add(30 * day), false, false},
		{"a year's admin.conf with 6 days left", now.Add(-year + 6*day), now.Add(6 * day), true, false},
		{"a minute's credential, ended", now.Add(-2 * time.Minute), now.Add(-time.Minute), false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := readOperatorCredential(&rest.Config{TLSClientConfig: rest.TLSClientConfig{CertData: adminCertPEM(t, tc.from, tc.to)}}, now)
			if tc.expired {
				var ee *exitError
				if !errors.As(err, &ee) || ee.code != exitFailure || !strings.Contains(err.Error(), "berth kubeconfig") || !strings.Contains(err.Error(), "expired") {
					t.Fatalf("expired credential: err = %v, want an exit-1 error naming berth kubeconfig", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.ExpiresSoon != tc.soon {
				t.Errorf("ExpiresSoon = %v, want %v", c.ExpiresSoon, tc.soon)
			}
			var out bytes.Buffer
			printOperatorCredential(&out, c, now)
			if got := strings.Contains(out.String(), "WARNING: your credential expires"); got != tc.soon {
				t.Errorf("warning printed = %v, want %v:\n%s", got, tc.soon, out.String())
			}
		})
	}
}

// TestOperatorCredentialSources: a certificate file is read like inline data; a kubeconfig without a
// client certificate has no section; one that does not parse is the operator's input error.
func TestOperatorCredentialSources(t *testing.T) {
	now := time.Now()
	file := filepath.Join(t.TempDir(), "admin.crt")
	if err := os.WriteFile(file, adminCertPEM(t, now.Add(-time.Hour), now.Add(time.Hour)), 0o600); err != nil {
		t.Fatal(err)
	}
	if c, err := readOperatorCredential(&rest.Config{TLSClientConfig: rest.TLSClientConfig{CertFile: file}}, now); err != nil || c == nil || c.Subject != "berth-admin" || c.ExpiresSoon {
		t.Errorf("from a file: %+v, %v", c, err)
	}
	if c, err := readOperatorCredential(&rest.Config{BearerToken: "t"}, now); c != nil || err != nil {
		t.Errorf("token kubeconfig: %+v, %v; want no section", c, err)
	}
	_, err := readOperatorCredential(&rest.Config{TLSClientConfig: rest.TLSClientConfig{CertData: []byte("not pem")}}, now)
	var ee *exitError
	if !errors.As(err, &ee) || ee.code != exitUsage {
		t.Errorf("unparsable certificate: %v, want a usage error", err)
	}
}

// TestStatusShowsOperatorCredential: the section is in the text and the JSON report.
func TestStatusShowsOperatorCredential(t *testing.T) {
	now := time.Now()
	c, err := readOperatorCredential(&rest.Config{TLSClientConfig: rest.TLSClientConfig{CertData: adminCertPEM(t, now.Add(-23*time.Hour), now.Add(time.Hour))}}, now)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := runStatusRecords(context.Background(), &out, fake.NewClientset(), nil, c, "berth-system", "", 0, outputText); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Your credential: berth-admin") || !strings.Contains(out.String(), "berth kubeconfig --endpoint") {
		t.Errorf("text status lacks the credential's warning:\n%s", out.String())
	}
	out.Reset()
	if err := runStatusRecords(context.Background(), &out, fake.NewClientset(), nil, c, "berth-system", "", 0, outputJSON); err != nil {
		t.Fatal(err)
	}
	var r statusReport
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r.OperatorCredential == nil || !r.OperatorCredential.ExpiresSoon || r.OperatorCredential.Groups[0] != "kubeadm:cluster-admins" {
		t.Errorf("JSON operatorCredential = %+v", r.OperatorCredential)
	}
}
