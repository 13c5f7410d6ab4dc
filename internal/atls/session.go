package atls

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Session proofs: an attesting server that serves many clients need not quote for each. A
// SessionProof quotes in the background every SessionRenewal, over a fresh TLS key and the time of
// the quote (sessionNonce), and the server presents that certificate to every client that accepts
// one (ALPN "berth-s:v1") and sent no activation challenge. Per connection the server then spends
// no TPM command, no key generation and no certificate signature: the TLS handshake's own signature
// proves the server holds the key the document binds, in this connection.
//
// What a client gives up against a per-connection quote is freshness: the document is up to
// SessionRenewal old when served (the server stops serving it at sessionServeAge, falling back to a
// quote per connection), and the client refuses one older than its maximum age (DefaultSessionMaxAge,
// WithSessionMaxAge) or dated more than maxClockSkew ahead of its clock, with ErrStale. A measurement
// that changes after a quote shows within SessionRenewal; the lock register only changes at a reboot,
// which ends the process holding the key. A client whose validator must challenge the server's key
// (a TPM validator without akRoots) cannot use a session proof: the challenge is per connection.

// OIDSessionAttestation is the certificate extension of a session proof: sessionExtension's DER.
var OIDSessionAttestation = asn1.ObjectIdentifier{1, 3, 9901, 1, 5}

// ErrStale means the peer's session proof is older than this side accepts (or dated in its future).
var ErrStale = errors.New("peer's attestation is too old")

const (
	// SessionRenewal is how often a SessionProof quotes again.
	SessionRenewal = 10 * time.Second
	// DefaultSessionMaxAge is the oldest session proof a client accepts unless WithSessionMaxAge says
	// otherwise: six renewals, so that a renewal delayed by a busy TPM does not fail clients.
	DefaultSessionMaxAge = 60 * time.Second
	// sessionServeAge is the oldest proof a server still presents; older, it quotes per connection.
	sessionServeAge = 30 * time.Second
	// maxClockSkew is how far a session proof may be dated ahead of the client's clock.
	maxClockSkew = 10 * time.Second
	// sessionRetry is the wait before a failed renewal is tried again.
	sessionRetry = time.Second
	alpnSession  = "berth-s:v1"
	sessionInfo  = "berth atls session v1\x00"
)

// sessionExtension is the ASN.1 value of OIDSessionAttestation.
type sessionExtension struct {
	Variant  string `asn1:"utf8"`
	Document []byte
	// IssuedAt is the quote's time in Unix seconds; the document binds sessionNonce(IssuedAt).
	IssuedAt int64
}

// sessionNonce is the nonce a session proof's document binds.
func sessionNonce(issuedAt int64) []byte {
	h := sha256.New()
	h.Write([]byte(sessionInfo))
	h.Write(binary.BigEndian.AppendUint64(nil, uint64(issuedAt)))
	return h.Sum(nil)
}

// WithSessionProof makes an attesting server present p's certificate to clients that accept session
// proofs, instead of quoting per connection.
func WithSessionProof(p *SessionProof) Option { return func(o *options) { o.session = p } }

// WithSessionMaxAge sets the oldest session proof a client accepts (default DefaultSessionMaxAge);
// 0 makes it require a document for its own nonce from every server.
func WithSessionMaxAge(d time.Duration) Option { return func(o *options) { o.sessionMaxAge = d } }

// WithClock sets the clock a client judges session proofs by (default time.Now).
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

// SessionProof is an attesting server's certificate for many connections, renewed by Run.
type SessionProof struct {
	issuer Issuer
	log    *zap.Logger
	now    func() time.Time
	cur    atomic.Pointer[sessionCert]
}

type sessionCert struct {
	cert     *tls.Certificate
	issuedAt time.Time
}

// NewSessionProof returns a SessionProof for issuer; it has no certificate until Renew or Run made one.
func NewSessionProof(issuer Issuer, log *zap.Logger, opts ...Option) *SessionProof {
	o := buildOptions(opts)
	if log == nil {
		log = zap.NewNop()
	}
	return &SessionProof{issuer: issuer, log: log, now: o.now}
}

// Renew makes a new key and has the issuer attest it with the current time.
func (p *SessionProof) Renew(ctx context.Context) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generating session key: %w", err)
	}
	userData, err := keyHash(&key.PublicKey)
	if err != nil {
		return fmt.Errorf("hashing session key: %w", err)
	}
	at := p.now().Truncate(time.Second)
	doc, err := p.issuer.Issue(ctx, userData, sessionNonce(at.Unix()))
	if err != nil {
		return fmt.Errorf("issuing session attestation: %w", err)
	}
	ext, err := asn1.Marshal(sessionExtension{Variant: p.issuer.Variant(), Document: doc, IssuedAt: at.Unix()})
	if err != nil {
		return fmt.Errorf("encoding session attestation: %w", err)
	}
	cert, err := selfSigned(key, pkix.Extension{Id: OIDSessionAttestation, Value: ext})
	if err != nil {
		return err
	}
	p.cur.Store(&sessionCert{cert: cert, issuedAt: at})
	return nil
}

// Run renews the proof now and every SessionRenewal (a second after a failure) until ctx ends; it
// returns nil then. Failures are logged: clients get a quote per connection meanwhile.
func (p *SessionProof) Run(ctx context.Context) error {
	failing := false
	for {
		wait := SessionRenewal
		if err := p.Renew(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if !failing {
				p.log.Warn("renewing the session attestation failed: quoting per connection", zap.Error(err))
			}
			failing, wait = true, sessionRetry
		} else if failing {
			p.log.Info("session attestation renewed again")
			failing = false
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// current returns the certificate to present, or nil when there is none young enough.
func (p *SessionProof) current() *tls.Certificate {
	c := p.cur.Load()
	if c == nil || p.now().Sub(c.issuedAt) > sessionServeAge {
		return nil
	}
	return c.cert
}

// offersSession reports whether a client accepts session proofs.
func offersSession(protos []string) bool { return slices.Contains(protos, alpnSession) }

// checkSessionAge refuses a session proof issued at issuedAt that is older than maxAge or dated
// beyond the clock skew.
func checkSessionAge(issuedAt int64, maxAge time.Duration, now time.Time) error {
	at := time.Unix(issuedAt, 0)
	switch age := now.Sub(at); {
	case age > maxAge:
		return fmt.Errorf("%w: session attestation made %s ago, at most %s accepted", ErrStale, age.Truncate(time.Second), maxAge)
	case age < -maxClockSkew:
		return fmt.Errorf("%w: session attestation dated %s ahead of this clock", ErrStale, (-age).Truncate(time.Second))
	}
	return nil
}

// KeyCertifier is a Challenger validator that can also accept a peer whose attestation key a CA of
// its policy certified (vtpm.Validator with akRoots): then it needs no challenge, no identity probe,
// and it accepts session proofs.
type KeyCertifier interface {
	// CertifiesKeys reports whether the policy trusts such CAs.
	CertifiesKeys() bool
	// ValidateCertified validates like Validate and requires the document's key to be certified.
	ValidateCertified(ctx context.Context, doc, nonce []byte) (attestation.Result, error)
}

// certifier returns the validator's KeyCertifier side when it certifies keys.
func certifier(v Validator) (KeyCertifier, bool) {
	kc, ok := v.(KeyCertifier)
	if !ok || !kc.CertifiesKeys() {
		return nil, false
	}
	return kc, true
}

// needsProbe reports whether a client validating with v must probe the server's identity first: to
// challenge it, unless a CA certifies keys.
func needsProbe(v Validator) bool {
	if _, ok := v.(Challenger); !ok {
		return false
	}
	_, certifies := certifier(v)
	return !certifies
}
