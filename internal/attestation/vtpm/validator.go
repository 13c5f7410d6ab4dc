package vtpm

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/asn1"
	"encoding/binary"
	"errors"
	"fmt"
	"math/big"
	"sort"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
)

// Validator checks TPM attestation documents against a policy. It is safe for concurrent use.
//
// It pays for a TPM's identity once: the EK certificate chain, the EK public area and the AK's
// creation record of a document that passed are remembered (identities, keyed by a hash of their
// exact bytes, up to maxIdentities), and later documents with the same bytes only have their quote
// checked. A policy change builds a new Validator (the joinservice's policywatch does), so nothing
// verified under an old policy carries over.
type Validator struct {
	policy  *policy.Policy
	roots   *x509.CertPool
	akRoots *x509.CertPool // nil: the policy certifies no attestation keys
	log     *zap.Logger
	now     func() time.Time
	// maxIdentities bounds identities (the constant of that name; tests lower it).
	maxIdentities int

	mu         sync.Mutex
	activated  map[string]struct{}                     // identities whose AK was proven to live with the EK
	identities map[[sha256.Size]byte]*verifiedIdentity // EK chains and AK creation records that verified
}

// verifiedIdentity is what a verified EK chain and AK creation record leave for later validations.
type verifiedIdentity struct {
	akKey    crypto.PublicKey // the AK's public key, checked to be a restricted, TPM-bound signing key
	akName   []byte           // the AK's name
	identity []byte           // the machine identity, SHA-256 of the EK public area
	// ekVerified says the EK's trust (its certificate chain or pin) and the AK's creation record
	// under it were checked; an identity accepted on its AK certificate alone (ValidateCertified)
	// has them checked when plain Validate meets it.
	ekVerified bool
	// certified says the document's AK certificate verified against the policy's akRoots; certErr
	// says why not.
	certified bool
	certErr   string
	// notAfter is when the first certificate of the EK chain (and of a verified AK certificate's
	// chain) expires: then it is verified again.
	notAfter time.Time
}

// maxIdentities bounds the identities a Validator remembers; when full, one is forgotten for each
// new one, which then costs a full verification again the next time.
const maxIdentities = 4096

// NewValidator returns a Validator for p, whose variant must be "tpm" and whose trust roots are the
// EK CA certificates (roots or intermediates; any of them anchors a chain).
func NewValidator(p *policy.Policy, log *zap.Logger) (*Validator, error) {
	if p.Variant != Variant {
		return nil, fmt.Errorf("%w: policy is for %q, not %q", attestation.ErrUnknownVariant, p.Variant, Variant)
	}
	switch {
	case p.EKTrust() == policy.EKTrustPinned && len(p.TrustRoots) > 0:
		return nil, fmt.Errorf("%w: tpm.ekTrust: pinned trusts the listed EKs only; remove trustRoots (an EK certificate is no alternative to a pin)", policy.ErrInvalid)
	case p.EKTrust() == policy.EKTrustCertificate && len(p.TrustRoots) == 0:
		return nil, fmt.Errorf("%w: a tpm policy needs at least one EK CA in trustRoots (or tpm.ekTrust: pinned with the EKs' digests)", policy.ErrInvalid)
	}
	for _, e := range p.Expectations {
		if e.Index > 23 {
			return nil, fmt.Errorf("%w: %s: a TPM has PCRs 0..23, not %d", policy.ErrInvalid, e.Source, e.Index)
		}
		for _, val := range e.AnyOf {
			if len(val) != sha256.Size {
				return nil, fmt.Errorf("%w: %s: PCR %d expects %d bytes, SHA-256 PCRs have %d", policy.ErrInvalid, e.Source, e.Index, len(val), sha256.Size)
			}
		}
	}
	if log == nil {
		log = zap.NewNop()
	}
	v := &Validator{policy: p, roots: p.CertPool(), log: log, now: time.Now, maxIdentities: maxIdentities, activated: map[string]struct{}{},
		identities: map[[sha256.Size]byte]*verifiedIdentity{}}
	if len(p.AKRoots) > 0 {
		v.akRoots = x509.NewCertPool()
		for _, c := range p.AKRoots {
			v.akRoots.AddCert(c)
		}
	}
	return v, nil
}

// CertifiesKeys reports whether the policy trusts CAs that certify attestation keys (akRoots), so
// that ValidateCertified can accept a document without an activation.
func (v *Validator) CertifiesKeys() bool { return v.akRoots != nil }

// ValidateCertified is Validate for a document whose AK was not activated in this handshake: it also
// requires an AK certificate from one of the policy's akRoots for the document's AK and EK
// (ErrUntrustedRoot otherwise).
func (v *Validator) ValidateCertified(_ context.Context, raw, nonce []byte) (attestation.Result, error) {
	doc, err := ParseDocument(raw)
	if err != nil {
		return attestation.Result{}, err
	}
	res, known, err := v.validate(doc, nonce, true)
	if known == nil {
		return res, err
	}
	if !known.certified {
		return res, fmt.Errorf("%w: attestation key not certified by a CA the policy trusts: %s", attestation.ErrUntrustedRoot, known.certErr)
	}
	return res, err
}

// Variant returns "tpm".
func (v *Validator) Variant() string { return Variant }

// Policy returns the policy the validator judges by.
func (v *Validator) Policy() *policy.Policy { return v.policy }

// Validate checks doc against nonce and the policy. On success the result carries the document's user
// data, which the caller must compare with what it expects (aTLS: the peer's TLS key).
func (v *Validator) Validate(_ context.Context, raw, nonce []byte) (attestation.Result, error) {
	doc, err := ParseDocument(raw)
	if err != nil {
		return attestation.Result{}, err
	}
	res, _, err := v.validate(doc, nonce, false)
	return res, err
}

// validate checks a parsed document and returns the verified identity with the result (nil when the
// identity did not verify): the quote's signature and the signer's identity before the nonce, so
// that ErrNonceMismatch always means a quote signed by a key whose identity verified. certified: the
// caller accepts only a certified AK (ValidateCertified), so a valid AK certificate establishes the
// identity (verifyIdentity).
func (v *Validator) validate(doc *Document, nonce []byte, certified bool) (attestation.Result, *verifiedIdentity, error) {
	quote, err := decodeAttest(doc.Quote)
	if err != nil {
		return attestation.Result{}, nil, fmt.Errorf("%w: decoding quote: %w", attestation.ErrMalformed, err)
	}
	if quote.typ != tpm2.TPMSTAttestQuote {
		return attestation.Result{}, nil, fmt.Errorf("%w: quote has type %#x", attestation.ErrMalformed, quote.typ)
	}
	key := identityKey(doc)
	known := v.knownIdentity(key)
	var ak publicArea
	if known != nil {
		ak.key, ak.name = known.akKey, known.akName
	} else if ak, err = attestationKey(doc.AKPublic); err != nil {
		return attestation.Result{}, nil, err
	}
	akKey := ak.key
	if err := verifySignature(akKey, doc.Quote, doc.QuoteSignature); err != nil {
		return attestation.Result{}, nil, fmt.Errorf("%w: quote: %w", attestation.ErrBadSignature, err)
	}
	selected, banks := quote.sha256PCRs()
	if banks != 1 || len(selected) != len(doc.PCRs) {
		return attestation.Result{}, nil, fmt.Errorf("%w: quote selects %v, document carries %d PCRs", attestation.ErrMalformed, selected, len(doc.PCRs))
	}
	for _, p := range selected {
		if _, ok := doc.PCRs[uint32(p)]; !ok {
			return attestation.Result{}, nil, fmt.Errorf("%w: quoted PCR %d missing from document", attestation.ErrMalformed, p)
		}
	}
	if subtle.ConstantTimeCompare(quote.pcrDigest, pcrDigest(doc.PCRs, selected)) != 1 {
		return attestation.Result{}, nil, fmt.Errorf("%w: PCR values do not match the quoted digest", attestation.ErrBadSignature)
	}
	if known == nil || !known.ekVerified && (!certified || !known.certified) {
		if known, err = v.verifyIdentity(doc, ak, certified); err != nil {
			return attestation.Result{}, nil, err
		}
		v.rememberIdentity(key, known)
	}
	// Only now, with the signature verified under an AK whose identity verified, is a quote for
	// another nonce evidence that a TPM once made it (a replay). Checked before the signature, a
	// forged quote for another nonce cost its sender nothing and still counted as a replay.
	if !quoteBinds(doc, quote.extraData, extraData(doc.UserData, nonce)) {
		return attestation.Result{}, known, fmt.Errorf("%w: the quote was made for another nonce or other user data", attestation.ErrNonceMismatch)
	}
	measurements := attestation.Measurements(doc.PCRs)
	if len(doc.EventLog) > 0 {
		if err := verifyEventLog(doc.EventLog, measurements); err != nil {
			return attestation.Result{}, nil, err
		}
	}
	res := attestation.Result{Variant: Variant, UserData: doc.UserData, Measurements: measurements, Identity: known.identity}
	res.Warnings, err = v.policy.Evaluate(measurements)
	for _, w := range res.Warnings {
		v.log.Warn("measurement deviates from warn-only expectation", zap.String("detail", w))
	}
	return res, known, err
}

// verifyIdentity establishes whose TPM made doc. For a caller that accepts only a certified AK
// (certified), a valid AK certificate from akRoots is enough: its CA vouched that the AK lives with
// the named EK when it issued it (Issuer.CertifyAK activates the AK, and the joinservice checks its
// own EK against the cluster's policy first), and whoever holds the CA key could vouch for any EK
// certificate and creation record as well, so checking them again would prove nothing more. A pinned
// policy still requires the EK's pin. Otherwise, or when the certificate does not verify, the EK's
// trust and the AK's creation record are checked (verifyEK), and the certificate is recorded besides.
func (v *Validator) verifyIdentity(doc *Document, ak publicArea, certified bool) (*verifiedIdentity, error) {
	if certified && v.akRoots != nil {
		if notAfter, err := verifyAKCert(doc, ak.key, v.akRoots, v.now()); err == nil {
			if ak.nameErr != nil {
				return nil, fmt.Errorf("%w: AK name: %w", attestation.ErrMalformed, ak.nameErr)
			}
			if v.policy.EKTrust() == policy.EKTrustPinned {
				if _, _, err := v.trustEK(doc); err != nil {
					return nil, err
				}
			}
			return &verifiedIdentity{akKey: ak.key, akName: ak.name, identity: ekIdentity(doc.EKPublic), certified: true, notAfter: notAfter}, nil
		}
	}
	id, err := v.verifyEK(doc, ak)
	if err != nil {
		return nil, err
	}
	id.ekVerified = true
	v.certify(doc, id)
	return id, nil
}

// VerifyIdentity checks only the identity in doc: that the policy trusts its EK (certificate chain or
// pin) and that its AK, a restricted TPM-bound signing key, was created under that EK. Neither the
// quote nor the measurements are looked at. A certifier checks its own document this way before its
// AK certificate stands in for these checks (ValidateCertified).
func (v *Validator) VerifyIdentity(doc *Document) error {
	ak, err := attestationKey(doc.AKPublic)
	if err != nil {
		return err
	}
	_, err = v.verifyEK(doc, ak)
	return err
}

// certify records in id whether the document's AK certificate verifies against the policy's akRoots.
func (v *Validator) certify(doc *Document, id *verifiedIdentity) {
	if v.akRoots == nil {
		id.certErr = "the policy lists no akRoots"
		return
	}
	notAfter, err := verifyAKCert(doc, id.akKey, v.akRoots, v.now())
	if err != nil {
		id.certErr = err.Error()
		return
	}
	id.certified = true
	if notAfter.Before(id.notAfter) {
		id.notAfter = notAfter
	}
}

// identityKey is the cache key of a document's TPM identity: a hash over the exact bytes of every
// field the identity checks read, each length-prefixed.
func identityKey(doc *Document) [sha256.Size]byte {
	h := sha256.New()
	var n [4]byte
	for _, f := range [][]byte{doc.EKCert, doc.EKPublic, doc.AKPublic, doc.AKCreationData, doc.AKCertifyInfo, doc.AKCertifySignature, doc.AKCert} {
		binary.BigEndian.PutUint32(n[:], uint32(len(f)))
		h.Write(n[:])
		h.Write(f)
	}
	var k [sha256.Size]byte
	h.Sum(k[:0])
	return k
}

// knownIdentity returns the remembered identity for key, or nil (also once its EK chain expired).
func (v *Validator) knownIdentity(key [sha256.Size]byte) *verifiedIdentity {
	v.mu.Lock()
	defer v.mu.Unlock()
	id := v.identities[key]
	if id != nil && v.now().After(id.notAfter) {
		delete(v.identities, key)
		return nil
	}
	return id
}

func (v *Validator) rememberIdentity(key [sha256.Size]byte, id *verifiedIdentity) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.identities) >= v.maxIdentities {
		for k := range v.identities { // map order: an arbitrary one
			delete(v.identities, k)
			break
		}
	}
	v.identities[key] = id
}

// quoteBinds reports whether a quote with qualifying data covers leaf: directly, or through the
// document's batch, which must then hold leaf and hash to the qualifying data.
func quoteBinds(doc *Document, qualifying, leaf []byte) bool {
	if len(doc.Batch) == 0 {
		return subtle.ConstantTimeCompare(qualifying, leaf) == 1
	}
	found := false
	for _, l := range doc.Batch {
		found = found || subtle.ConstantTimeCompare(l, leaf) == 1
	}
	return found && subtle.ConstantTimeCompare(qualifying, batchDigest(doc.Batch)) == 1
}

// attestationKey decodes the AK public area and checks that it is a restricted signing key that
// never left the TPM it was created in.
func attestationKey(raw []byte) (publicArea, error) {
	pub, err := parsePublic(raw)
	if err != nil {
		return publicArea{}, fmt.Errorf("%w: decoding AK public area: %w", attestation.ErrMalformed, err)
	}
	if !pub.has(attrFixedTPM|attrFixedParent|attrSensitiveDataOrigin|attrRestricted|attrSignEncrypt) || pub.has(attrDecrypt) {
		return publicArea{}, fmt.Errorf("%w: AK is not a restricted, TPM-bound signing key", attestation.ErrUntrustedRoot)
	}
	if pub.keyErr != nil {
		return publicArea{}, fmt.Errorf("%w: AK public key: %w", attestation.ErrMalformed, pub.keyErr)
	}
	return pub, nil
}

// verifySignature checks a TPMT_SIGNATURE over SHA-256(msg).
func verifySignature(pub crypto.PublicKey, msg, rawSig []byte) error {
	sig, err := decodeSignature(rawSig)
	if err != nil {
		return fmt.Errorf("decoding signature: %w", err)
	}
	digest := sha256.Sum256(msg)
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if sig.alg != tpm2.TPMAlgECDSA || sig.hash != tpm2.TPMAlgSHA256 {
			return errors.New("not an ECDSA-SHA256 signature")
		}
		r, ss := new(big.Int).SetBytes(sig.r), new(big.Int).SetBytes(sig.s)
		if !ecdsa.Verify(k, digest[:], r, ss) {
			return errors.New("signature does not verify")
		}
		return nil
	case *rsa.PublicKey:
		if sig.alg != tpm2.TPMAlgRSASSA || sig.hash != tpm2.TPMAlgSHA256 {
			return errors.New("not an RSASSA-SHA256 signature")
		}
		return rsa.VerifyPKCS1v15(k, crypto.SHA256, digest[:], sig.rsa)
	default:
		return fmt.Errorf("unsupported key type %T", pub)
	}
}

// pinnedNotAfter is when the identity cache forgets an identity whose EK the policy pins: never on
// its own (a policy change builds a new validator).
var pinnedNotAfter = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)

// trustEK checks that the policy trusts the document's EK: its certificate chains to a trust root
// (the certificate is returned, to be matched with the EK), or, with tpm.ekTrust: pinned, its public
// area's digest is pinned (no certificate is consulted). notAfter is when that trust must be checked
// again.
func (v *Validator) trustEK(doc *Document) (cert *x509.Certificate, notAfter time.Time, err error) {
	if v.policy.EKTrust() == policy.EKTrustPinned {
		id := ekIdentity(doc.EKPublic)
		if !v.policy.TPM.PinsEK(id) {
			return nil, time.Time{}, fmt.Errorf("%w: EK %x is not among the policy's pinned EKs (tpm.ekPublicSHA256)", attestation.ErrUntrustedRoot, id)
		}
		return nil, pinnedNotAfter, nil
	}
	if cert, err = parseEKCert(doc.EKCert); err != nil {
		return nil, time.Time{}, fmt.Errorf("%w: %w", attestation.ErrUntrustedRoot, err)
	}
	chains, err := cert.Verify(x509.VerifyOptions{Roots: v.roots, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}, CurrentTime: v.now()})
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("%w: EK certificate: %w", attestation.ErrUntrustedRoot, err)
	}
	notAfter = cert.NotAfter
	for _, c := range chains[0] {
		if c.NotAfter.Before(notAfter) {
			notAfter = c.NotAfter
		}
	}
	return cert, notAfter, nil
}

// verifyEK checks that the policy trusts the document's EK (trustEK: a certificate for it chaining
// to a trust root, or its pin), and that the AK (ak, decoded from doc.AKPublic) was created under that
// EK (TPM2_CertifyCreation, signed by the AK). It returns what later validations of the same identity
// reuse. That the AK lives with the EK is proven apart: by activation or an AK certificate.
func (v *Validator) verifyEK(doc *Document, ak publicArea) (*verifiedIdentity, error) {
	cert, notAfter, err := v.trustEK(doc)
	if err != nil {
		return nil, err
	}
	ek, err := parsePublic(doc.EKPublic)
	if err != nil {
		return nil, fmt.Errorf("%w: decoding EK public area: %w", attestation.ErrMalformed, err)
	}
	if !ek.has(attrFixedTPM | attrRestricted | attrDecrypt) {
		return nil, fmt.Errorf("%w: EK is not a restricted TPM-bound decryption key", attestation.ErrUntrustedRoot)
	}
	if ek.keyErr != nil {
		return nil, fmt.Errorf("%w: EK public key: %w", attestation.ErrMalformed, ek.keyErr)
	}
	if cert != nil {
		if k, ok := cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool }); !ok || !k.Equal(ek.key) {
			return nil, fmt.Errorf("%w: EK certificate is for another key", attestation.ErrUntrustedRoot)
		}
	}
	if ek.nameErr != nil {
		return nil, fmt.Errorf("%w: EK name: %w", attestation.ErrMalformed, ek.nameErr)
	}

	// The AK's creation record names its parent; the CertifyCreation attestation, signed by the AK,
	// ties that record to the AK.
	if ak.nameErr != nil {
		return nil, fmt.Errorf("%w: AK name: %w", attestation.ErrMalformed, ak.nameErr)
	}
	akKey := ak.key
	if err := verifySignature(akKey, doc.AKCertifyInfo, doc.AKCertifySignature); err != nil {
		return nil, fmt.Errorf("%w: AK creation certificate: %w", attestation.ErrUntrustedRoot, err)
	}
	creation, err := decodeAttest(doc.AKCertifyInfo)
	if err != nil || creation.typ != tpm2.TPMSTAttestCreation {
		return nil, fmt.Errorf("%w: AK creation certificate is not a creation attestation", attestation.ErrUntrustedRoot)
	}
	creationHash := sha256.Sum256(doc.AKCreationData)
	if !bytes.Equal(creation.objectName, ak.name) || !bytes.Equal(creation.creationHash, creationHash[:]) {
		return nil, fmt.Errorf("%w: AK creation certificate is for another key", attestation.ErrUntrustedRoot)
	}
	parent, err := parentName(doc.AKCreationData)
	if err != nil {
		return nil, err
	}
	if !bytes.Equal(parent, ek.name) {
		return nil, fmt.Errorf("%w: AK was not created under the certified EK", attestation.ErrUntrustedRoot)
	}
	return &verifiedIdentity{akKey: akKey, akName: ak.name, identity: ekIdentity(doc.EKPublic), notAfter: notAfter}, nil
}

// oidSubjectAltName is the SAN extension; EK certificates mark it critical and fill it with TPM
// manufacturer attributes in a directoryName, which crypto/x509 leaves unhandled.
var oidSubjectAltName = asn1.ObjectIdentifier{2, 5, 29, 17}

// parseEKCert parses an EK certificate and accepts its critical SAN with TPM attributes.
func parseEKCert(der []byte) (*x509.Certificate, error) {
	if len(der) == 0 {
		return nil, errors.New("document has no EK certificate")
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parsing EK certificate: %w", err)
	}
	kept := cert.UnhandledCriticalExtensions[:0]
	for _, oid := range cert.UnhandledCriticalExtensions {
		if !oid.Equal(oidSubjectAltName) {
			kept = append(kept, oid)
		}
	}
	cert.UnhandledCriticalExtensions = kept
	return cert, nil
}

// Measurements returns the quoted PCR values in doc without trusting them; for display only.
func Measurements(raw []byte) ([]uint32, attestation.Measurements, error) {
	doc, err := ParseDocument(raw)
	if err != nil {
		return nil, nil, err
	}
	idx := make([]uint32, 0, len(doc.PCRs))
	for i := range doc.PCRs {
		idx = append(idx, i)
	}
	sort.Slice(idx, func(a, b int) bool { return idx[a] < idx[b] })
	return idx, doc.PCRs, nil
}
