// Package catest makes throwaway cluster CAs for tests of the joinservice: a self-signed P-256 CA as
// PEM, or written to a directory the way kubeadm lays out /etc/kubernetes/pki, alone (WriteDir) or
// with the shared control-plane files a control plane's ticket carries (WriteControlPlaneDir).
package catest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// PEM returns a new CA's certificate and EC private key, PEM-encoded. It is valid from an hour ago
// to an hour from now.
func PEM(t testing.TB) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "kubernetes"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}

// WriteDir writes a new CA as ca.crt and ca.key into a temporary directory and returns it.
func WriteDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	cert, key := PEM(t)
	writeFiles(t, dir, map[string][]byte{"ca.crt": cert, "ca.key": key})
	return dir
}

// ControlPlaneFiles are the files of a PKI directory besides ca.crt and ca.key that a control
// plane's ticket carries, as kubeadm lays them out.
var ControlPlaneFiles = []string{"sa.key", "sa.pub", "front-proxy-ca.crt", "front-proxy-ca.key", "etcd/ca.crt", "etcd/ca.key"}

// WriteControlPlaneDir writes a new CA as ca.crt and ca.key into a temporary directory, and every
// one of ControlPlaneFiles with the content "contents of NAME", and returns the directory.
func WriteControlPlaneDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	cert, key := PEM(t)
	files := map[string][]byte{"ca.crt": cert, "ca.key": key}
	for _, name := range ControlPlaneFiles {
		files[name] = []byte("contents of " + name)
	}
	writeFiles(t, dir, files)
	return dir
}

// writeFiles writes files (slash-separated names) below dir, creating subdirectories.
func writeFiles(t testing.TB, dir string, files map[string][]byte) {
	t.Helper()
	for name, data := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}
