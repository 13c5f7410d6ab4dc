package vtpm

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"time"

	"github.com/google/go-tpm/tpm2"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/certsign"
)

// Certified attestation keys. Credential activation proves to one verifier that an AK lives with a
// certified EK, and costs the attester's TPM an EK decryption for every verifier. An AK certificate
// proves the same to everyone who trusts its CA, once: a CA that activated the AK (or otherwise knows
// it lives with the EK) issues an X.509 certificate for the AK's public key naming the EK's identity
// (OIDAKEndorsementKey: SHA-256 of the EK public area). A validator whose policy lists the CA in
// akRoots accepts such a document without a challenge (Validator.ValidateCertified).
//
// The CA Berth uses is a cluster's (AKCA): an Ed25519 key derived from the cluster's master secret,
// so every control plane and the operator derive the same CA; each joinservice certifies its own AK
// at start after activating it against its own TPM. What a verifier trusting the CA relies on, beyond
// the EK chain: that the CA key stays with the cluster's control planes and its operator.

// OIDAKEndorsementKey is the extension of an AK certificate naming the EK the AK lives with: an
// OCTET STRING holding SHA-256 of the EK's public area (TPMT_PUBLIC). The arc is Berth's unregistered
// one (see atls.OIDAttestation).
var OIDAKEndorsementKey = asn1.ObjectIdentifier{1, 3, 9901, 2, 1}

// akCertValidity is how long an AK certificate from AKCA.Certify is valid.
const akCertValidity = 365 * 24 * time.Hour

// AKCA certifies attestation keys. It is deterministic: the same seed and name give the same key and
// the same CA certificate (DER), so it can be derived wherever the seed is known.
type AKCA struct {
	// Cert is the self-signed CA certificate: what a policy's akRoots lists.
	Cert *x509.Certificate
	key  ed25519.PrivateKey
}

// NewAKCA derives a CA from a 32-byte seed (clusterkeys.Keys.AKCASeed) under the common name name.
func NewAKCA(seed []byte, name string) (*AKCA, error) {
	if len(seed) != ed25519.SeedSize {
		return nil, fmt.Errorf("deriving attestation-key CA: seed of %d bytes, want %d", len(seed), ed25519.SeedSize)
	}
	key := ed25519.NewKeyFromSeed(seed)
	// Fixed serial and validity, and Ed25519's deterministic signatures: the same DER everywhere.
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC),
		NotAfter:              time.Date(2125, 1, 1, 0, 0, 0, 0, time.UTC),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(nil, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("creating attestation-key CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parsing attestation-key CA certificate: %w", err)
	}
	return &AKCA{Cert: cert, key: key}, nil
}

// ClusterAKCA is a cluster's attestation-key CA: derived from seed (clusterkeys.Keys.AKCASeed) and
// named for the cluster ID, so every control plane and the operator derive the same certificate.
// Listed in a join policy's akRoots, it lets nodes accept the cluster's joinservices without
// activating their keys.
func ClusterAKCA(seed, clusterID []byte) (*AKCA, error) {
	return NewAKCA(seed, fmt.Sprintf("berth cluster attestation-key CA %x", clusterID[:min(8, len(clusterID))]))
}

// PEM returns the CA certificate in PEM form, as a policy's akRoots entry takes it.
func (ca *AKCA) PEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})
}

// Certify issues the certificate for an attestation key (its TPMT_PUBLIC) that lives with the EK whose
// public area is ekPublic. The caller vouches for that (Issuer.CertifyAK activates first).
func (ca *AKCA) Certify(akPublic, ekPublic []byte) ([]byte, error) {
	ak, err := attestationKey(akPublic)
	if err != nil {
		return nil, fmt.Errorf("certifying attestation key: %w", err)
	}
	ekID, err := asn1.Marshal(ekIdentity(ekPublic))
	if err != nil {
		return nil, fmt.Errorf("encoding EK identity: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generating serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:    serial,
		Subject:         pkix.Name{CommonName: "berth attestation key"},
		NotBefore:       now.Add(-time.Hour),
		NotAfter:        now.Add(akCertValidity),
		KeyUsage:        x509.KeyUsageDigitalSignature,
		ExtraExtensions: []pkix.Extension{{Id: OIDAKEndorsementKey, Value: ekID}},
	}
	// The CA key is ours, in memory: signed once, not verified again (internal/certsign).
	der, err := certsign.Create(rand.Reader, tmpl, ca.Cert, ak.key, ca.key)
	if err != nil {
		return nil, fmt.Errorf("certifying attestation key: %w", err)
	}
	return der, nil
}

// verifyAKCert checks doc's AK certificate against roots: it chains to one, it is for the AK's key
// (akKey) and it names the document's EK. It returns when the chain expires.
func verifyAKCert(doc *Document, akKey crypto.PublicKey, roots *x509.CertPool, now time.Time) (time.Time, error) {
	if len(doc.AKCert) == 0 {
		return time.Time{}, errors.New("the document carries no attestation-key certificate")
	}
	cert, err := x509.ParseCertificate(doc.AKCert)
	if err != nil {
		return time.Time{}, fmt.Errorf("parsing attestation-key certificate: %w", err)
	}
	chains, err := cert.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}, CurrentTime: now})
	if err != nil {
		return time.Time{}, fmt.Errorf("attestation-key certificate: %w", err)
	}
	if k, ok := cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool }); !ok || !k.Equal(akKey) {
		return time.Time{}, errors.New("attestation-key certificate is for another key")
	}
	var ekID []byte
	for _, e := range cert.Extensions {
		if e.Id.Equal(OIDAKEndorsementKey) {
			if rest, err := asn1.Unmarshal(e.Value, &ekID); err != nil || len(rest) != 0 {
				return time.Time{}, errors.New("attestation-key certificate: malformed EK identity")
			}
		}
	}
	if !bytes.Equal(ekID, ekIdentity(doc.EKPublic)) {
		return time.Time{}, errors.New("attestation-key certificate names another EK")
	}
	notAfter := cert.NotAfter
	for _, c := range chains[0] {
		if c.NotAfter.Before(notAfter) {
			notAfter = c.NotAfter
		}
	}
	return notAfter, nil
}

// CertifyAK proves to itself that the AK lives with the EK in this TPM (a credential activation
// against its own EK), then has certify issue the AK's certificate (AKCA.Certify fits) and puts it
// into every document from now on. The certificate is dropped when the AK is recreated.
func (i *Issuer) CertifyAK(ctx context.Context, certify func(akPublic, ekPublic []byte) ([]byte, error)) error {
	i.mu.Lock()
	defer i.mu.Unlock()
	c, err := openTPM(ctx, i.open)
	if err != nil {
		return err
	}
	defer func() { _ = c.Close() }() // best effort: the commands already answered
	if err := i.ensureAK(c); err != nil {
		return err
	}
	ekPub, err := tpm2.Unmarshal[tpm2.TPMTPublic](i.ak.ekPublic)
	if err != nil {
		return fmt.Errorf("%w: own EK: %w", attestation.ErrMalformed, err)
	}
	ekKey, err := tpm2.ImportEncapsulationKey(ekPub)
	if err != nil {
		return fmt.Errorf("own EK: %w", err)
	}
	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return fmt.Errorf("generating activation secret: %w", err)
	}
	idObject, encSecret, err := tpm2.CreateCredential(rand.Reader, ekKey, i.ak.name.Buffer, secret)
	if err != nil {
		return fmt.Errorf("making credential for own AK: %w", err)
	}
	got, err := i.activate(c, idObject, encSecret)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, secret) {
		return fmt.Errorf("%w: this TPM's AK does not activate against its EK", attestation.ErrUntrustedRoot)
	}
	der, err := certify(i.ak.public.Bytes(), i.ak.ekPublic)
	if err != nil {
		return err
	}
	i.ak.akCert = der
	return nil
}
