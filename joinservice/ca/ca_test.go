package ca

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/joinservice/ca/catest"
)

func testCA(t *testing.T) *Authority {
	t.Helper()
	a, err := New(catest.PEM(t))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func TestSignUsesAttestedNameNotClaimedOne(t *testing.T) {
	a := testCA(t)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "system:node:control-plane-0", Organization: []string{"system:masters"}},
	}, key)
	out, err := a.SignKubeletClient(csr, "worker-1", []net.IP{net.ParseIP("198.51.100.21")}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(out)
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if cert.Subject.CommonName != "system:node:worker-1" || strings.Join(cert.Subject.Organization, ",") != "system:nodes" {
		t.Fatalf("subject = %v, want system:node:worker-1 in system:nodes", cert.Subject)
	}
	if err := cert.CheckSignatureFrom(a.cert); err != nil {
		t.Fatalf("certificate not signed by the CA: %v", err)
	}
	if !strings.HasPrefix(a.Pin(), "sha256:") || len(a.Pin()) != 7+64 {
		t.Fatalf("Pin() = %q", a.Pin())
	}
}

func TestSignRejectsBadCSR(t *testing.T) {
	a := testCA(t)
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	weakCSR, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, weak)
	if err != nil {
		t.Fatal(err)
	}
	for name, der := range map[string][]byte{"garbage": []byte("nope"), "RSA-1024 key": weakCSR} {
		if _, err := a.SignKubeletClient(der, "n", nil, time.Hour); !errors.Is(err, ErrBadCSR) {
			t.Errorf("%s: SignKubeletClient() = %v, want ErrBadCSR", name, err)
		}
	}
}

// TestSignIgnoresCSRSignature: the CSR's signature is not a proof anything relies on (see
// SignKubeletClient); a CSR whose signature is broken still gets only the attested name and
// addresses, over the CSR's key, signed by the CA.
func TestSignIgnoresCSRSignature(t *testing.T) {
	a := testCA(t)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: "system:node:victim", Organization: []string{"system:masters"}},
	}, key)
	csr[len(csr)-3] ^= 0xff // break the signature
	if parsed, err := x509.ParseCertificateRequest(csr); err != nil || parsed.CheckSignature() == nil {
		t.Fatalf("the CSR should parse with a broken signature: %v", err)
	}
	out, err := a.SignKubeletClient(csr, "attested-0", []net.IP{net.ParseIP("198.51.100.20")}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	checkIssued(t, a, out, &key.PublicKey)
}

// BenchmarkSignKubeletClient is the CA's share of a join: one P-256 CSR certified by the P-256 CA.
func BenchmarkSignKubeletClient(b *testing.B) {
	a, err := New(catest.PEM(b))
	if err != nil {
		b.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	ips := []net.IP{net.ParseIP("198.51.100.20")}
	for b.Loop() {
		if _, err := a.SignKubeletClient(csr, "attested-0", ips, time.Hour); err != nil {
			b.Fatal(err)
		}
	}
}

func TestSignAdminClientRefusesBadKeys(t *testing.T) {
	authority := testCA(t)
	weak, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	weakDER, _ := x509.MarshalPKIXPublicKey(weak.Public())
	for name, der := range map[string][]byte{"not DER": []byte("nonsense"), "RSA 1024": weakDER, "empty": nil} {
		if _, _, err := authority.SignAdminClient(der, time.Hour); !errors.Is(err, ErrBadPublicKey) {
			t.Errorf("%s: %v, want ErrBadPublicKey", name, err)
		}
	}
}
