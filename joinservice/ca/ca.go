// Package ca signs kubelet client certificates with the cluster CA that kubeadm created, and
// computes the CA pin kubeadm join uses for discovery.
package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/berth-k8s/berth/internal/certsign"
)

// ErrBadCSR is returned for a CSR that does not parse or whose key cannot be certified.
var ErrBadCSR = errors.New("invalid certificate signing request")

// ErrBadPublicKey is returned for an admin's public key that does not parse or cannot be certified.
var ErrBadPublicKey = errors.New("invalid public key")

// The subject of an admin credential (SignAdminClient): the group is the one kubeadm puts its
// admin.conf in and binds to cluster-admin (a ClusterRoleBinding that an operator can change, unlike
// system:masters, which no authorizer can take anything from).
const (
	AdminUser  = "berth-admin"
	AdminGroup = "kubeadm:cluster-admins"
)

// Authority is the cluster CA.
type Authority struct {
	cert    *x509.Certificate
	certPEM []byte
	key     crypto.Signer
	now     func() time.Time
}

// Load reads ca.crt and ca.key from kubeadm's PKI directory.
func Load(pkiDir string) (*Authority, error) {
	certPEM, err := os.ReadFile(filepath.Join(pkiDir, "ca.crt"))
	if err != nil {
		return nil, fmt.Errorf("reading CA certificate: %w", err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(pkiDir, "ca.key"))
	if err != nil {
		return nil, fmt.Errorf("reading CA key: %w", err)
	}
	return New(certPEM, keyPEM)
}

// New parses a PEM CA certificate and its PEM private key (PKCS#1, PKCS#8 or SEC 1).
func New(certPEM, keyPEM []byte) (*Authority, error) {
	cb, _ := pem.Decode(certPEM)
	if cb == nil {
		return nil, errors.New("CA certificate is not PEM")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parsing CA certificate: %w", err)
	}
	kb, _ := pem.Decode(keyPEM)
	if kb == nil {
		return nil, errors.New("CA key is not PEM")
	}
	key, err := parseKey(kb.Bytes)
	if err != nil {
		return nil, err
	}
	return &Authority{cert: cert, certPEM: certPEM, key: key, now: time.Now}, nil
}

func parseKey(der []byte) (crypto.Signer, error) {
	if k, err := x509.ParsePKCS1PrivateKey(der); err == nil {
		return k, nil
	}
	if k, err := x509.ParseECPrivateKey(der); err == nil {
		return k, nil
	}
	k, err := x509.ParsePKCS8PrivateKey(der)
	if err != nil {
		return nil, errors.New("CA key is neither PKCS#1, SEC 1 nor PKCS#8")
	}
	s, ok := k.(crypto.Signer)
	if !ok {
		return nil, errors.New("CA key cannot sign")
	}
	return s, nil
}

// CertPEM returns the CA certificate.
func (a *Authority) CertPEM() []byte { return append([]byte(nil), a.certPEM...) }

// Pin returns kubeadm's discovery pin of the CA: "sha256:" + hex SHA-256 of its SubjectPublicKeyInfo.
func (a *Authority) Pin() string {
	sum := sha256.Sum256(a.cert.RawSubjectPublicKeyInfo)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// SignKubeletClient issues a kubelet client certificate for nodeName over the CSR's public key.
// Everything the CSR claims besides its key is ignored: the subject is "system:node:<nodeName>"
// in "system:nodes", and the IP SANs are ips.
//
// The CSR's own signature (proof that the requester holds the key) is not checked: it buys nothing
// here. The caller has attested the requester and names the node; the certificate says only what
// was attested. A requester that asked for a certificate over a key it does not hold gets a
// certificate it cannot use, and whoever holds that key gains what the attested node could give
// away anyway by handing out its own key. The kubelet proves possession where it matters, in every
// TLS handshake with the API server. The check was a P-256 verification on every join.
func (a *Authority) SignKubeletClient(csrDER []byte, nodeName string, ips []net.IP, validity time.Duration) ([]byte, error) {
	csr, err := x509.ParseCertificateRequest(csrDER)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadCSR, err)
	}
	if err := checkKey(csr.PublicKey); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadCSR, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generating serial: %w", err)
	}
	now := a.now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "system:node:" + nodeName, Organization: []string{"system:nodes"}},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     now.Add(validity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		IPAddresses:  ips,
	}
	// The key is the CA's own, in memory: signed once, not verified again (internal/certsign).
	der, err := certsign.Create(rand.Reader, tmpl, a.cert, csr.PublicKey, a.key)
	if err != nil {
		return nil, fmt.Errorf("signing kubelet certificate: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}

// checkKey refuses keys the cluster would not trust: other types than ECDSA, Ed25519 and RSA, and
// RSA keys under 2048 bits.
func checkKey(pub any) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey, ed25519.PublicKey:
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return fmt.Errorf("an RSA key of %d bits, want at least 2048", k.N.BitLen())
		}
	default:
		return fmt.Errorf("a public key of type %T", pub)
	}
	return nil
}

// SignAdminClient issues an admin client certificate (AdminUser in AdminGroup) over the public key
// publicKeyDER (a DER SubjectPublicKeyInfo), valid from now for validity. It returns the certificate
// (PEM) and its serial number, for the audit log. The caller has checked who asks.
func (a *Authority) SignAdminClient(publicKeyDER []byte, validity time.Duration) (certPEM []byte, serial *big.Int, err error) {
	pub, err := x509.ParsePKIXPublicKey(publicKeyDER)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrBadPublicKey, err)
	}
	if err := checkKey(pub); err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrBadPublicKey, err)
	}
	serial, err = rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, nil, fmt.Errorf("generating serial: %w", err)
	}
	now := a.now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: AdminUser, Organization: []string{AdminGroup}},
		// No backdating beyond a minute: the validity asked for is what the operator gets, and a
		// short one must end when it says.
		NotBefore:   now.Add(-time.Minute),
		NotAfter:    now.Add(validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := certsign.Create(rand.Reader, tmpl, a.cert, pub, a.key)
	if err != nil {
		return nil, nil, fmt.Errorf("signing admin certificate: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), serial, nil
}
