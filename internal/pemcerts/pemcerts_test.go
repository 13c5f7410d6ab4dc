package pemcerts

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"strings"
	"testing"
	"time"
)

func certPEM(t *testing.T, cn string) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: cn}, NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func TestParse(t *testing.T) {
	a, b := certPEM(t, "a"), certPEM(t, "b")
	key := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: []byte{1}})
	data := append(append(append([]byte("# comment\n"), a...), key...), append(b, 0, 0, 0)...)
	certs, err := Parse(data)
	if err != nil || len(certs) != 2 || certs[0].Subject.CommonName != "a" || certs[1].Subject.CommonName != "b" {
		t.Fatalf("Parse = %v, %v; want a and b in order", certs, err)
	}
	if _, err := Parse(key); !errors.Is(err, ErrNoCertificate) {
		t.Errorf("no certificate: %v", err)
	}
	bad := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte("junk")})
	if _, err := Parse(append(a, bad...)); err == nil || !strings.Contains(err.Error(), "certificate 1") {
		t.Errorf("broken second certificate: %v, want an error naming certificate 1", err)
	}
}
