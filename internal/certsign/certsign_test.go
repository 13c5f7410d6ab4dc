package certsign

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net"
	"testing"
	"time"
)

func template(serial int64) *x509.Certificate {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	return &x509.Certificate{
		SerialNumber: big.NewInt(serial),
		Subject:      pkix.Name{CommonName: "system:node:worker-1", Organization: []string{"system:nodes"}},
		NotBefore:    now,
		NotAfter:     now.Add(time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		IPAddresses:  []net.IP{net.ParseIP("198.51.100.7")},
		ExtraExtensions: []pkix.Extension{
			{Id: []int{1, 3, 6, 1, 4, 1, 99999, 1}, Value: []byte{0x04, 0x01, 0x2a}},
		},
	}
}

func caCert(t *testing.T, key crypto.Signer) *x509.Certificate {
	t.Helper()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Unix(0, 0), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func keys(t *testing.T) map[string]crypto.Signer {
	t.Helper()
	ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	r, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return map[string]crypto.Signer{"ecdsa": ec, "rsa": r, "ed25519": ed}
}

// TestCreateMatchesCreateCertificate: for every key type, the certificate parses, verifies under the
// issuer's key (and as a self-signed one under its own) and has the TBS x509.CreateCertificate makes
// from the same template; Ed25519's deterministic signatures make the whole DER equal.
func TestCreateMatchesCreateCertificate(t *testing.T) {
	leaf, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	for name, key := range keys(t) {
		t.Run(name, func(t *testing.T) {
			ca := caCert(t, key)
			for kind, c := range map[string]struct {
				parent *x509.Certificate
				pub    any
			}{"issued": {ca, &leaf.PublicKey}, "self-signed": {template(7), key.Public()}} {
				got, err := Create(rand.Reader, template(7), c.parent, c.pub, key)
				if err != nil {
					t.Fatalf("%s: Create: %v", kind, err)
				}
				want, err := x509.CreateCertificate(rand.Reader, template(7), c.parent, c.pub, key)
				if err != nil {
					t.Fatal(err)
				}
				gc, err := x509.ParseCertificate(got)
				if err != nil {
					t.Fatalf("%s: the certificate does not parse: %v", kind, err)
				}
				wc, err := x509.ParseCertificate(want)
				if err != nil {
					t.Fatal(err)
				}
				if err := checkSig(gc, key.Public()); err != nil {
					t.Fatalf("%s: the signature does not verify under the issuer's key: %v", kind, err)
				}
				if c.parent == ca {
					if err := gc.CheckSignatureFrom(ca); err != nil {
						t.Fatalf("%s: CheckSignatureFrom(CA): %v", kind, err)
					}
				}
				if !bytes.Equal(gc.RawTBSCertificate, wc.RawTBSCertificate) || gc.SignatureAlgorithm != wc.SignatureAlgorithm {
					t.Fatalf("%s: TBS or algorithm differs from x509.CreateCertificate's", kind)
				}
				if name == "ed25519" && !bytes.Equal(got, want) {
					t.Fatalf("%s: Ed25519 certificate differs from x509.CreateCertificate's", kind)
				}
			}
		})
	}
}

// checkSig verifies cert's signature under pub, whoever the certificate names as issuer.
func checkSig(cert *x509.Certificate, pub crypto.PublicKey) error {
	issuer := &x509.Certificate{PublicKey: pub, PublicKeyAlgorithm: cert.PublicKeyAlgorithm}
	switch pub.(type) {
	case *ecdsa.PublicKey:
		issuer.PublicKeyAlgorithm = x509.ECDSA
	case *rsa.PublicKey:
		issuer.PublicKeyAlgorithm = x509.RSA
	case ed25519.PublicKey:
		issuer.PublicKeyAlgorithm = x509.Ed25519
	}
	return issuer.CheckSignature(cert.SignatureAlgorithm, cert.RawTBSCertificate, cert.Signature)
}

// TestCreateRefusesWhatCreateCertificateRefuses: the template's checks still run (a key that does
// not match the parent, a negative serial), and a certificate signed by another key does not verify
// under the issuer's.
func TestCreateRefusesWhatCreateCertificateRefuses(t *testing.T) {
	ks := keys(t)
	ca := caCert(t, ks["ecdsa"])
	if _, err := Create(rand.Reader, template(7), ca, ks["rsa"].Public(), ks["rsa"]); err == nil {
		t.Error("Create with a key that is not the parent's: no error")
	}
	if _, err := Create(rand.Reader, template(-1), ca, ks["rsa"].Public(), ks["ecdsa"]); err == nil {
		t.Error("Create with a negative serial: no error")
	}
	other, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	otherCA := caCert(t, other)
	otherCA.RawSubject = ca.RawSubject
	der, err := Create(rand.Reader, template(7), otherCA, ks["rsa"].Public(), other)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	if err := cert.CheckSignatureFrom(ca); err == nil {
		t.Error("a certificate signed by another key verifies under the CA")
	}
}

func TestSignatureAlgorithmRefusesMalformedTBS(t *testing.T) {
	for name, tbs := range map[string][]byte{
		"empty":            nil,
		"not a sequence":   {0x02, 0x01, 0x01},
		"trailing data":    {0x30, 0x00, 0x00},
		"no algorithm":     {0x30, 0x03, 0x02, 0x01, 0x01},
		"algorithm as int": {0x30, 0x06, 0x02, 0x01, 0x01, 0x02, 0x01, 0x01},
	} {
		if _, err := signatureAlgorithm(tbs); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func BenchmarkCreate(b *testing.B) {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leaf, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{PublicKey: &key.PublicKey, Subject: pkix.Name{CommonName: "ca"}}
	b.Run("certsign", func(b *testing.B) {
		for b.Loop() {
			if _, err := Create(rand.Reader, template(7), ca, &leaf.PublicKey, key); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("x509", func(b *testing.B) {
		for b.Loop() {
			if _, err := x509.CreateCertificate(rand.Reader, template(7), ca, &leaf.PublicKey, key); err != nil {
				b.Fatal(err)
			}
		}
	})
}
