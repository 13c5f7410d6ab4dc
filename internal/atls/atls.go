// Package atls is attested TLS: TLS 1.3 whose certificates carry an attestation document bound to the
// certificate's key and to a nonce the peer chose for this one connection.
//
// Protocol, per connection:
//   - Every attesting side uses a fresh ECDSA P-256 key and a self-signed certificate holding, in an
//     extension (OIDAttestation), the variant and the document Issue(SHA-256(PKIX(key)), nonce).
//   - The client's nonce for the server travels in the SNI (32 random bytes, base32); the server's
//     nonce for the client travels as the common name of the single acceptable CA in the
//     CertificateRequest. Both are fresh per handshake.
//   - The validating side checks the document inside the handshake (VerifyPeerCertificate): variant,
//     Validate(doc, nonce) and that the document's user data is the hash of the key that the peer
//     proved possession of in this handshake. Nothing reaches the application before that.
//
// Modes: server attests (berth init: the node attests to the CLI), client attests, and mutual (join).
//
// An attesting server with a SessionProof (session.go) presents one certificate, quoted in the
// background every SessionRenewal over its key and the time, to clients that accept it: no TPM work
// per connection. Clients accept one up to DefaultSessionMaxAge old, when their validator needs no
// challenge (a TDX validator, or a TPM validator whose policy trusts a CA that certified the server's
// attestation key, KeyCertifier); such a client makes no identity probe either.
//
// An attesting client that is a Claimer also states its measurements in its ClientHello, and a
// validating server with WithClaimCheck refuses a client whose claims fail before it quotes,
// activates or validates anything, with a TLS alert before its own first handshake message
// (claims.go): a rejected node costs the server reading its ClientHello.
//
// Validators that are Challengers (TPM) also require key activation inside the handshake; see
// activation.go. A client validating such a server first probes the server's identity over a separate
// connection (Dial and Credentials do this), so its handshake costs one extra TLS round trip but no
// extra quote; unless its policy certifies attestation keys (KeyCertifier), which replaces the
// activation.
//
// Every document costs a quote, so an attesting server rate-limits handshakes that ask for one: per
// peer IP 2/s with a burst of 8, and globally 20/s with a burst of 40 (DefaultLimits). A quote takes
// about 1 ms on swtpm (measured, see internal/attestation/README.md); on a hardware TPM, which runs one
// command at a time, assume 10-50 ms. 20/s then bounds the TPM time spent on attestation to 20-100%
// of the TPM: choose a lower Global limit with WithLimiter for slow TPMs. 2/s per peer lets one client
// retry every second without starving the others. An excess handshake gets a certificate without
// attestation that carries a refusal (OIDRefusal); the client fails it with ErrRateLimited. Producing
// that costs a map lookup, no quote and no signature.
package atls

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base32"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"strings"
	"time"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/certsign"
)

// Issuer produces attestation documents (implemented by the variants, e.g. vtpm.Issuer).
type Issuer interface {
	// Variant names the attestation variant.
	Variant() string
	// Issue returns a document binding userData and nonce.
	Issue(ctx context.Context, userData, nonce []byte) ([]byte, error)
}

// Validator checks attestation documents (implemented by the variants, e.g. vtpm.Validator).
type Validator interface {
	// Variant names the attestation variant the validator accepts.
	Variant() string
	// Validate checks doc against nonce and the validator's policy and returns what it proves.
	Validate(ctx context.Context, doc, nonce []byte) (attestation.Result, error)
}

var (
	// OIDAttestation is the certificate extension holding the attestation. The arc 1.3.9901 is
	// unregistered and private to Berth; move it under a registered enterprise number before a release.
	OIDAttestation = asn1.ObjectIdentifier{1, 3, 9901, 1, 1}
	// OIDRefusal marks a certificate that refuses to attest; its value is the reason.
	OIDRefusal = asn1.ObjectIdentifier{1, 3, 9901, 1, 2}
)

// Named handshake failures beyond the validation errors of package attestation.
var (
	// ErrRateLimited means the attesting peer refused to attest because of its handshake rate limit.
	ErrRateLimited = errors.New("peer is rate-limiting attested handshakes")
	// ErrNoAttestation means the peer's certificate carries no attestation.
	ErrNoAttestation = errors.New("peer certificate carries no attestation")
	// ErrNoNonce means the peer did not send a nonce to attest with.
	ErrNoNonce = errors.New("peer sent no attestation nonce")
)

const (
	nonceSize = 32
	// sniSuffix follows the base32 nonce in the SNI.
	sniSuffix = ".atls.berth.invalid"
	// caNoncePrefix prefixes the hex nonce in the acceptable CA's common name.
	caNoncePrefix = "berth-atls-nonce-"
	// validateTimeout bounds a validation inside a handshake.
	validateTimeout = 30 * time.Second
)

var nonceEncoding = base32.HexEncoding.WithPadding(base32.NoPadding)

// extension is the ASN.1 value of the attestation extension.
type extension struct {
	Variant  string `asn1:"utf8"`
	Document []byte
}

// Evidence is what a validating side saw from its peer in one handshake.
type Evidence struct {
	// Variant is the variant the peer claimed.
	Variant string
	// Document is the peer's raw attestation document.
	Document []byte
	// Nonce is the nonce the document must bind: the one this side chose for the handshake, with the
	// activation secret mixed in when the key was activated.
	Nonce []byte
	// Activated says the peer's attestation key is proven to live with its certified endorsement key
	// (TPM credential activation, in this handshake or an earlier one with the same validator).
	Activated bool
	// Certificate is the peer's DER leaf certificate, which holds the document; with Nonce it is all
	// VerifyRecorded needs to reach the same verdict again.
	Certificate []byte
	// IssuedAt is when a session proof was made (session.go); zero for a document made for this
	// handshake's nonce.
	IssuedAt time.Time
	// Result is the validation result; its Measurements are set also when the policy rejected them.
	Result attestation.Result
}

// newNonce returns nonceSize random bytes.
func newNonce() ([]byte, error) {
	n := make([]byte, nonceSize)
	if _, err := rand.Read(n); err != nil {
		return nil, fmt.Errorf("generating nonce: %w", err)
	}
	return n, nil
}

// keyHash is the user data an attesting side binds: SHA-256 over the PKIX public key.
func keyHash(pub any) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return nil, err
	}
	h := sha256.Sum256(der)
	return h[:], nil
}

// attestedCertificate creates a certificate attesting key (nil: a fresh one) with nonce.
func attestedCertificate(ctx context.Context, issuer Issuer, key *ecdsa.PrivateKey, nonce []byte) (*tls.Certificate, error) {
	if key == nil {
		var err error
		if key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
			return nil, fmt.Errorf("generating TLS key: %w", err)
		}
	}
	userData, err := keyHash(&key.PublicKey)
	if err != nil {
		return nil, fmt.Errorf("hashing TLS key: %w", err)
	}
	doc, err := issuer.Issue(ctx, userData, nonce)
	if err != nil {
		return nil, fmt.Errorf("issuing attestation: %w", err)
	}
	ext, err := asn1.Marshal(extension{Variant: issuer.Variant(), Document: doc})
	if err != nil {
		return nil, fmt.Errorf("encoding attestation extension: %w", err)
	}
	return selfSigned(key, pkix.Extension{Id: OIDAttestation, Value: ext})
}

// selfSigned wraps key in a short-lived self-signed certificate with extra extensions.
func selfSigned(key *ecdsa.PrivateKey, exts ...pkix.Extension) (*tls.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("generating serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:    serial,
		Subject:         pkix.Name{CommonName: "berth attested TLS"},
		NotBefore:       now.Add(-2 * time.Hour),
		NotAfter:        now.Add(2 * time.Hour),
		KeyUsage:        x509.KeyUsageDigitalSignature,
		ExtKeyUsage:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		ExtraExtensions: exts,
	}
	// A fresh key of ours, in memory: signed once, not verified again (internal/certsign).
	der, err := certsign.Create(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("creating certificate: %w", err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// verifyPeer validates the peer's leaf certificate against nonce and reports the evidence to observe.
func verifyPeer(ctx context.Context, chk peerCheck, rawCerts [][]byte, observe func(Evidence, error)) error {
	ev, err := checkPeer(ctx, chk, rawCerts)
	if observe != nil {
		observe(ev, err)
	}
	return err
}

// peerCheck is how one handshake validates its peer: the variant and validation function (the
// validator's Validate, or the one bound to an activation challenge) and the nonce the document must
// bind (with the activation secret mixed in, when there was a challenge).
type peerCheck struct {
	variant   string
	validate  func(ctx context.Context, doc, nonce []byte) (attestation.Result, error)
	nonce     []byte
	activated bool
	// session allows a session proof (session.go), no older than sessionMaxAge by now (0: any age,
	// for re-verifying recorded evidence).
	session       bool
	sessionMaxAge time.Duration
	now           func() time.Time
	// ofServer: this side validates a server, which may refuse it (rate limit, claims) instead of
	// attesting; a client's certificate never refuses anything. claimed: this side sent claims, the
	// only case in which a verdict on claims is an answer and not a peer's invention.
	ofServer, claimed bool
}

// plainCheck validates with validator and nonce, without activation.
func plainCheck(validator Validator, nonce []byte) peerCheck {
	return peerCheck{variant: validator.Variant(), validate: validator.Validate, nonce: nonce}
}

func checkPeer(ctx context.Context, chk peerCheck, rawCerts [][]byte) (Evidence, error) {
	ev := Evidence{Nonce: chk.nonce, Activated: chk.activated}
	if len(rawCerts) == 0 {
		return ev, ErrNoAttestation
	}
	ev.Certificate = rawCerts[0]
	cert, err := x509.ParseCertificate(rawCerts[0])
	if err != nil {
		return ev, fmt.Errorf("%w: parsing peer certificate: %w", attestation.ErrMalformed, err)
	}
	var raw, session []byte
	for _, e := range cert.Extensions {
		switch {
		case e.Id.Equal(OIDRefusal):
			if !chk.ofServer {
				return ev, fmt.Errorf("%w: a client's certificate refuses to attest", attestation.ErrMalformed)
			}
			// The refusal's text is the peer's: only the named error is reported.
			return ev, ErrRateLimited
		case e.Id.Equal(OIDClaimRejection):
			if !chk.ofServer || !chk.claimed {
				return ev, fmt.Errorf("%w: a verdict on claims this side never made", attestation.ErrMalformed)
			}
			return ev, parseRejection(e.Value)
		case e.Id.Equal(OIDAttestation):
			raw = e.Value
		case e.Id.Equal(OIDSessionAttestation):
			session = e.Value
		}
	}
	var ext extension
	switch {
	case raw != nil && session != nil:
		return ev, fmt.Errorf("%w: both a per-connection and a session attestation", attestation.ErrMalformed)
	case session != nil:
		if !chk.session {
			return ev, fmt.Errorf("%w: a session attestation this side did not ask for", ErrNoAttestation)
		}
		var s sessionExtension
		if rest, err := asn1.Unmarshal(session, &s); err != nil || len(rest) != 0 {
			return ev, fmt.Errorf("%w: session attestation extension is not valid ASN.1", attestation.ErrMalformed)
		}
		ev.IssuedAt, ev.Nonce = time.Unix(s.IssuedAt, 0), sessionNonce(s.IssuedAt)
		if chk.sessionMaxAge > 0 {
			if err := checkSessionAge(s.IssuedAt, chk.sessionMaxAge, chk.now()); err != nil {
				ev.Variant, ev.Document = shownVariant(s.Variant), s.Document
				return ev, err
			}
		}
		ext, chk.nonce = extension{Variant: s.Variant, Document: s.Document}, ev.Nonce
	case raw != nil:
		if rest, err := asn1.Unmarshal(raw, &ext); err != nil || len(rest) != 0 {
			return ev, fmt.Errorf("%w: attestation extension is not valid ASN.1", attestation.ErrMalformed)
		}
	default:
		return ev, ErrNoAttestation
	}
	ev.Variant, ev.Document = shownVariant(ext.Variant), ext.Document
	if ext.Variant != chk.variant {
		return ev, fmt.Errorf("%w: peer attests with %q, policy wants %q", attestation.ErrUnknownVariant, sanitize([]byte(ext.Variant)), chk.variant)
	}
	if chk.validate == nil {
		return ev, ErrNotActivated
	}
	ctx, cancel := context.WithTimeout(ctx, validateTimeout)
	defer cancel()
	res, err := chk.validate(ctx, ext.Document, chk.nonce)
	ev.Result = res
	if err != nil {
		return ev, err
	}
	want, err := keyHash(cert.PublicKey)
	if err != nil {
		return ev, fmt.Errorf("%w: peer key: %w", attestation.ErrMalformed, err)
	}
	if subtle.ConstantTimeCompare(res.UserData, want) != 1 {
		return ev, attestation.ErrKeyBinding
	}
	return ev, nil
}

// VerifyRecorded reaches the handshake's verdict again, offline, on a recorded peer certificate and
// the nonce its document binds (Evidence.Nonce): the same checks and errors, except that a key
// activation cannot be repeated without the peer.
func VerifyRecorded(ctx context.Context, validator Validator, certificate, nonce []byte) (Evidence, error) {
	chk := plainCheck(validator, nonce)
	chk.session = true // a recorded session proof: its own nonce; its age is no longer the question
	return checkPeer(ctx, chk, [][]byte{certificate})
}

// shownVariant is a variant name as Evidence reports it: a name of lower-case letters, digits and
// dashes (every real variant) as it is, anything else quoted, escaped and short, so that whoever
// prints Evidence.Variant never prints a peer's words verbatim.
func shownVariant(v string) string {
	ok := len(v) > 0 && len(v) <= 32
	for _, r := range v {
		ok = ok && (r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-')
	}
	if ok {
		return v
	}
	return strconv.Quote(sanitize([]byte(v)))
}

// sanitize renders untrusted bytes printable and short for error messages.
func sanitize(b []byte) string {
	if len(b) > 64 {
		b = b[:64]
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e {
			return '?'
		}
		return r
	}, string(b))
}

// encodeSNINonce puts a nonce into a server name.
func encodeSNINonce(nonce []byte) string {
	return strings.ToLower(nonceEncoding.EncodeToString(nonce)) + sniSuffix
}

// decodeSNINonce extracts the nonce from a server name.
func decodeSNINonce(name string) ([]byte, error) {
	enc, ok := strings.CutSuffix(name, sniSuffix)
	if !ok {
		return nil, ErrNoNonce
	}
	n, err := nonceEncoding.DecodeString(strings.ToUpper(enc))
	if err != nil || len(n) != nonceSize {
		return nil, ErrNoNonce
	}
	return n, nil
}

// nonceCAPool returns a pool with one pseudo CA whose subject carries the nonce; TLS 1.3 sends it to
// the client as the acceptable certificate authorities.
func nonceCAPool(nonce []byte) (*x509.CertPool, error) {
	subject, err := asn1.Marshal(pkix.Name{CommonName: caNoncePrefix + hex.EncodeToString(nonce)}.ToRDNSequence())
	if err != nil {
		return nil, fmt.Errorf("encoding nonce subject: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(&x509.Certificate{Raw: subject, RawSubject: subject})
	return pool, nil
}

// decodeCANonce finds the nonce among the acceptable CAs of a CertificateRequest.
func decodeCANonce(acceptable [][]byte) ([]byte, error) {
	for _, der := range acceptable {
		var rdn pkix.RDNSequence
		if rest, err := asn1.Unmarshal(der, &rdn); err != nil || len(rest) != 0 {
			continue
		}
		var name pkix.Name
		name.FillFromRDNSequence(&rdn)
		h, ok := strings.CutPrefix(name.CommonName, caNoncePrefix)
		if !ok {
			continue
		}
		n, err := hex.DecodeString(h)
		if err != nil || len(n) != nonceSize {
			continue
		}
		return n, nil
	}
	return nil, ErrNoNonce
}
