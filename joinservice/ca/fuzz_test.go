package ca

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/berth-k8s/berth/joinservice/ca/catest"
)

// checkIssued fails t unless der is a kubelet client certificate for the attested name and
// addresses over key, whatever else the CSR asked for.
func checkIssued(t *testing.T, a *Authority, pemCert []byte, key any) {
	t.Helper()
	cert := parsePEMCert(t, pemCert)
	switch {
	case cert.Subject.CommonName != "system:node:attested-0" || !slices.Equal(cert.Subject.Organization, []string{"system:nodes"}):
		t.Fatalf("issued subject %v, want system:node:attested-0 in system:nodes", cert.Subject)
	case len(cert.DNSNames)+len(cert.EmailAddresses)+len(cert.URIs) > 0 || len(cert.IPAddresses) != 1 || !cert.IPAddresses[0].Equal(net.ParseIP("198.51.100.20")):
		t.Fatalf("issued names: DNS %v, email %v, URI %v, IP %v; want only the attested IP", cert.DNSNames, cert.EmailAddresses, cert.URIs, cert.IPAddresses)
	case cert.IsCA || cert.BasicConstraintsValid && cert.IsCA:
		t.Fatal("issued a CA certificate")
	case !slices.Equal(cert.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}) || len(cert.UnknownExtKeyUsage) > 0:
		t.Fatalf("issued extended key usages %v %v, want client auth only", cert.ExtKeyUsage, cert.UnknownExtKeyUsage)
	case cert.CheckSignatureFrom(a.cert) != nil:
		t.Fatal("issued certificate is not signed by the CA")
	}
	want, _ := x509.MarshalPKIXPublicKey(key)
	if got, _ := x509.MarshalPKIXPublicKey(cert.PublicKey); !bytes.Equal(got, want) {
		t.Fatal("issued certificate is for another key than the CSR's")
	}
}

// FuzzSignKubeletClient signs arbitrary CSR bytes, as a joining node sends them: whatever parses and
// carries a key the CA certifies gets a certificate that says only what the joinservice attested.
func FuzzSignKubeletClient(f *testing.F) {
	a, err := New(catest.PEM(f))
	if err != nil {
		f.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	forged, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject:  pkix.Name{CommonName: "system:node:victim", Organization: []string{"system:masters"}},
		DNSNames: []string{"kubernetes.default"}, IPAddresses: []net.IP{net.ParseIP("10.96.0.1")},
	}, key)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(forged)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, csr []byte) {
		pemCert, err := a.SignKubeletClient(csr, "attested-0", []net.IP{net.ParseIP("198.51.100.20")}, time.Hour)
		if err != nil {
			return
		}
		parsed, err := x509.ParseCertificateRequest(csr)
		if err != nil {
			t.Fatalf("signed a CSR that does not parse: %v", err)
		}
		checkIssued(t, a, pemCert, parsed.PublicKey)
	})
}

// FuzzSignKubeletClientRequests builds correctly signed CSRs whose subject, names and requested
// extensions the fuzzer chooses (a CA's basic constraints, server auth, any OID): none of it reaches
// the certificate.
func FuzzSignKubeletClientRequests(f *testing.F) {
	a, err := New(catest.PEM(f))
	if err != nil {
		f.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTrue, _ := asn1.Marshal(struct{ IsCA bool }{true})
	f.Add("system:node:victim", "system:masters", "kubernetes.default", []byte{2, 5, 29, 19}, caTrue, true)
	f.Add("", "", "", []byte{2, 5, 29, 37}, []byte{0x30, 0x0a, 0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x01}, false)
	f.Fuzz(func(t *testing.T, cn, org, dns string, oid, value []byte, critical bool) {
		tmpl := &x509.CertificateRequest{Subject: pkix.Name{CommonName: cn, Organization: []string{org}}}
		if dns != "" {
			tmpl.DNSNames = []string{dns}
		}
		var id asn1.ObjectIdentifier
		if rest, err := asn1.Unmarshal(append([]byte{0x06, byte(len(oid))}, oid...), &id); err == nil && len(rest) == 0 && len(oid) < 128 {
			tmpl.ExtraExtensions = []pkix.Extension{{Id: id, Critical: critical, Value: value}}
		}
		csr, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
		if err != nil {
			return
		}
		pemCert, err := a.SignKubeletClient(csr, "attested-0", []net.IP{net.ParseIP("198.51.100.20")}, time.Hour)
		if err != nil {
			t.Fatalf("a correctly signed CSR was refused: %v", err)
		}
		checkIssued(t, a, pemCert, &key.PublicKey)
	})
}

func parsePEMCert(t *testing.T, b []byte) *x509.Certificate {
	t.Helper()
	block, _ := pem.Decode(b)
	if block == nil {
		t.Fatal("issued certificate is not PEM")
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatalf("issued certificate does not parse: %v", err)
	}
	return cert
}
