package ca

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
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
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	csr[len(csr)-3] ^= 0xff // break the signature
	for name, der := range map[string][]byte{"garbage": []byte("nope"), "bad signature": csr} {
		if _, err := a.SignKubeletClient(der, "n", nil, time.Hour); !errors.Is(err, ErrBadCSR) {
			t.Errorf("%s: SignKubeletClient() = %v, want ErrBadCSR", name, err)
		}
	}
}
