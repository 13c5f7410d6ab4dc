package atls

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
)

// Option configures the configs and credentials of this package.
type Option func(*options)

type options struct {
	limiter      *Limiter
	observe      func(Evidence, error)
	log          *zap.Logger
	peerIdentity []byte
	claimCheck   ClaimCheck
	claims       []string // a client's encoded claims, when claimsRead (read once per dial)
	claimsRead   bool
	// attestKey is the key a client's attested certificates use (Credentials reuse one); nil: a new one.
	attestKey     *ecdsa.PrivateKey
	session       *SessionProof
	sessionMaxAge time.Duration
	now           func() time.Time
	// knownPeers says which remote IPs are the cluster's own instances (their own attested budget).
	knownPeers func(peer string) bool
	// clientOptional: a validating server also accepts a client that presents no certificate.
	clientOptional bool
}

// known reports whether the server knows peer as its cluster's instance.
func (o options) known(peer string) bool { return o.knownPeers != nil && o.knownPeers(peer) }

// withClaims gives a client config the claims its dial already read for the probe.
func withClaims(claims []string) Option {
	return func(o *options) { o.claims, o.claimsRead = claims, true }
}

// WithLimiter sets the handshake rate limiter of an attesting server (default: NewLimiter(DefaultLimits)).
// Share one limiter between all listeners that use the same TPM.
func WithLimiter(l *Limiter) Option { return func(o *options) { o.limiter = l } }

// WithObserver calls f after every validation of a peer, with the evidence seen and the verdict.
func WithObserver(f func(Evidence, error)) Option { return func(o *options) { o.observe = f } }

// WithKnownPeers tells an attesting server which remote IPs belong to its cluster's instances (as
// metadata knows them): their attested handshakes draw from a budget of their own (Limits.Known),
// which a flood from any other address cannot use up. known must return at once.
func WithKnownPeers(known func(peer string) bool) Option {
	return func(o *options) { o.knownPeers = known }
}

// WithOptionalClientAttestation lets a server with a validator accept a client that presents no
// certificate at all (an operator's machine, which has nothing to attest with): its connection
// carries no Evidence (PeerEvidence reports false), so every handler must refuse what needs an
// attested peer. A client that presents a certificate is validated as without the option; an invalid
// one is refused in the handshake.
func WithOptionalClientAttestation() Option { return func(o *options) { o.clientOptional = true } }

// WithLogger sets the logger (default: no logging).
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.log = l } }

// WithPeerIdentity gives a client the server's activation identity (from ProbeIdentity), which a
// Challenger validator needs to challenge the server.
func WithPeerIdentity(id []byte) Option { return func(o *options) { o.peerIdentity = id } }

func buildOptions(opts []Option) options {
	o := options{log: zap.NewNop(), sessionMaxAge: DefaultSessionMaxAge, now: time.Now}
	for _, f := range opts {
		f(&o)
	}
	if o.limiter == nil {
		o.limiter = NewLimiter(DefaultLimits)
	}
	return o
}

// NewServerConfig returns the TLS config of a server. With an issuer the server attests to every
// client (the client must send a nonce); with a validator it requires every client to attest; with
// both the handshake is mutual. One config serves any number of connections: keys, nonces and
// documents are made per handshake.
func NewServerConfig(issuer Issuer, validator Validator, opts ...Option) (*tls.Config, error) {
	if issuer == nil && validator == nil {
		return nil, errors.New("creating aTLS server config: neither issuer nor validator")
	}
	attestKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating TLS key: %w", err)
	}
	certs, err := newServerCerts(attestKey)
	if err != nil {
		return nil, err
	}
	return serverConfig(issuer, validator, buildOptions(opts), certs), nil
}

// serverCerts are the keys and certificates a server reuses: made once, because refusing must stay
// cheap.
type serverCerts struct {
	key            *ecdsa.PrivateKey
	plain, refusal *tls.Certificate
	// attestKey is the key of attested certificates made per connection: the document binds it with
	// that connection's nonce, so one key serves every connection.
	attestKey *ecdsa.PrivateKey

	mu       sync.Mutex
	verdicts map[string]*tls.Certificate // probe answers by content, up to maxVerdictCerts
}

// maxVerdictCerts bounds the probe answers a server keeps signed.
const maxVerdictCerts = 256

// newServerCerts makes a server's reused certificates; attestKey is the key of its attested ones.
func newServerCerts(attestKey *ecdsa.PrivateKey) (*serverCerts, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating TLS key: %w", err)
	}
	refusal, err := selfSigned(key, pkix.Extension{Id: OIDRefusal, Value: []byte("handshake rate limit exceeded, retry later")})
	if err != nil {
		return nil, err
	}
	plain, err := selfSigned(key)
	if err != nil {
		return nil, err
	}
	return &serverCerts{key: key, plain: plain, refusal: refusal, attestKey: attestKey, verdicts: map[string]*tls.Certificate{}}, nil
}

// verdict returns the certificate carrying ext (a probe's identity), signing it only the first time.
func (c *serverCerts) verdict(ext pkix.Extension) (*tls.Certificate, error) {
	key := ext.Id.String() + "\x00" + string(ext.Value)
	c.mu.Lock()
	cert := c.verdicts[key]
	c.mu.Unlock()
	if cert != nil {
		return cert, nil
	}
	cert, err := selfSigned(c.key, ext)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.verdicts) >= maxVerdictCerts {
		clear(c.verdicts) // verdicts repeat: the next ones are signed again
	}
	c.verdicts[key] = cert
	return cert, nil
}

func serverConfig(issuer Issuer, validator Validator, o options, certs *serverCerts) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
			cfg := &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}}
			peer := peerHost(chi.Conn)
			ctx := chi.Context()
			if issuer == nil {
				cfg.Certificates = []tls.Certificate{*certs.plain}
			} else {
				if chi.ServerName == probeServerName {
					return probeConfig(ctx, issuer, validator != nil, o, certs, chi, peer)
				}
				nonce, err := decodeSNINonce(chi.ServerName)
				if err != nil {
					o.log.Info("refusing handshake without attestation nonce", zap.String("peer", peer))
					return nil, err
				}
				// Claims are judged before the attested budget is charged: a refusal is a TLS alert sent
				// before any handshake message of the server's, cheaper than any other answer. It is
				// charged to the peer, and a peer over its limit is not judged at all.
				if validator != nil {
					if !o.limiter.CanAttempt(peer) {
						o.log.Debug("refusing attestation: rate limit", zap.String("peer", peer))
						return refusalConfig(certs), nil
					}
					if err := refuseClaims(ctx, o, chi, peer); err != nil {
						o.limiter.ChargeRefusal(peer)
						return nil, err
					}
				}
				if !o.limiter.AllowHandshake(peer, o.known(peer)) {
					o.log.Debug("refusing attestation: rate limit", zap.String("peer", peer))
					return refusalConfig(certs), nil
				}
				challenge := fromALPN(alpnChallenge, chi.SupportedProtos)
				var cert *tls.Certificate
				if o.session != nil && challenge == nil && offersSession(chi.SupportedProtos) {
					cert = o.session.current() // nil when renewals fail: quote for this connection
				}
				if cert == nil {
					if challenge != nil {
						if a, ok := issuer.(Activator); ok {
							secret, err := a.Activate(ctx, challenge)
							if err != nil {
								// Answer anyway: the client's validation names the failure.
								o.log.Info("activating attestation key failed", zap.String("peer", peer), zap.Error(err))
								secret = nil
							}
							nonce = mixNonce(nonce, secret)
						}
					}
					var err error
					if cert, err = attestedCertificate(ctx, issuer, certs.attestKey, nonce); err != nil {
						o.log.Error("issuing attestation failed", zap.String("peer", peer), zap.Error(err))
						return nil, errors.New("attestation unavailable")
					}
				}
				cfg.Certificates = []tls.Certificate{*cert}
			}
			if validator != nil {
				nonce, err := newNonce()
				if err != nil {
					return nil, err
				}
				pool, err := nonceCAPool(nonce)
				if err != nil {
					return nil, err
				}
				chk := plainCheck(validator, nonce)
				if ch, ok := validator.(Challenger); ok {
					chk = peerCheck{variant: validator.Variant(), nonce: nonce} // no validate: rejects unless activated
					if id := fromALPN(alpnIdentity, chi.SupportedProtos); id != nil {
						challenge, secret, validate, err := ch.Challenge(id)
						if err == nil && challenge != nil {
							err = addChallengeCA(pool, challenge)
						}
						if err != nil {
							o.log.Info("cannot challenge client", zap.String("peer", peer), zap.Error(err))
						} else {
							chk = peerCheck{variant: validator.Variant(), validate: validate, nonce: nonce, activated: true}
							if secret != nil {
								chk.nonce = mixNonce(nonce, secret)
							}
						}
					}
				}
				cfg.ClientCAs = pool
				cfg.ClientAuth = tls.RequireAnyClientCert
				if o.clientOptional {
					cfg.ClientAuth = tls.RequestClientCert
				}
				cfg.VerifyPeerCertificate = func(rawCerts [][]byte, _ [][]*x509.Certificate) error {
					if len(rawCerts) == 0 && o.clientOptional {
						return nil // no evidence: the handlers refuse what needs it
					}
					err := verifyPeer(ctx, chk, rawCerts, o.observe)
					if err != nil {
						o.log.Info("rejected client attestation", zap.String("peer", peer), zap.Error(err))
					}
					return err
				}
			}
			return cfg, nil
		},
	}
}

// probeConfig answers a probe with the issuer's activation identity. Probes count against the rate
// limit like attestations: the first one per process creates the attestation key.
func probeConfig(ctx context.Context, issuer Issuer, validating bool, o options, certs *serverCerts, chi *tls.ClientHelloInfo, peer string) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, CurvePreferences: probeCurves}
	a, ok := issuer.(Activator)
	if !ok {
		// Nothing to activate: a certificate without identity tells the client so.
		cfg.Certificates = []tls.Certificate{*certs.plain}
		return cfg, nil
	}
	// A probe is unauthenticated work: charged to the peer and the unauthenticated budget (known
	// peers: their own), never to the attested one; admitted, it pays the peer's attested handshake
	// that follows.
	if !o.limiter.AllowProbe(peer, o.known(peer)) {
		return refusalConfig(certs), nil
	}
	if validating {
		if err := refuseClaims(ctx, o, chi, peer); err != nil {
			return nil, err
		}
	}
	cert, err := identityCertificate(ctx, a, certs)
	if err != nil {
		o.log.Error("reading attestation identity failed", zap.String("peer", peer), zap.Error(err))
		return nil, errors.New("attestation unavailable")
	}
	cfg.Certificates = []tls.Certificate{*cert}
	return cfg, nil
}

// NewClientConfig returns the TLS config for ONE client connection: it holds a fresh nonce, so build a
// new one per dial (Credentials and Dial do). With a validator the server must attest; a Challenger
// validator also needs WithPeerIdentity (from ProbeIdentity). With an issuer the client attests when
// the server asks, and volunteers its activation identity if it has one.
func NewClientConfig(ctx context.Context, issuer Issuer, validator Validator, opts ...Option) (*tls.Config, error) {
	o := buildOptions(opts)
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{"h2"},
		// Trust comes from the attestation, checked in VerifyPeerCertificate, not from a CA.
		InsecureSkipVerify: true, //nolint:gosec // verified by attestation below
	}
	if validator != nil {
		nonce, err := newNonce()
		if err != nil {
			return nil, err
		}
		cfg.ServerName = encodeSNINonce(nonce)
		chk := plainCheck(validator, nonce)
		chk.ofServer = true
		challenged := false
		if ch, ok := validator.(Challenger); ok {
			kc, certifies := certifier(validator)
			switch {
			case o.peerIdentity != nil:
				challenge, secret, validate, err := ch.Challenge(o.peerIdentity)
				if err != nil {
					return nil, fmt.Errorf("challenging server: %w", err)
				}
				chk = peerCheck{variant: validator.Variant(), validate: validate, nonce: nonce, activated: true, ofServer: true}
				if challenge != nil {
					cfg.NextProtos = append(cfg.NextProtos, toALPN(alpnChallenge, challenge)...)
					chk.nonce = mixNonce(nonce, secret)
					challenged = true
				}
			case certifies:
				// The server's key must be certified by a CA of the policy: no challenge.
				chk = peerCheck{variant: validator.Variant(), validate: kc.ValidateCertified, nonce: nonce, activated: true, ofServer: true}
			default:
				return nil, fmt.Errorf("creating aTLS client config: %w: the validator requires key activation and no server identity was probed", ErrNotActivated)
			}
		}
		if o.sessionMaxAge > 0 && !challenged {
			cfg.NextProtos = append(cfg.NextProtos, alpnSession)
			chk.session, chk.sessionMaxAge, chk.now = true, o.sessionMaxAge, o.now
		}
		cfg.VerifyPeerCertificate = func(rawCerts [][]byte, _ [][]*x509.Certificate) error {
			chk.claimed = claimsSent(cfg.NextProtos)
			return verifyPeer(ctx, chk, rawCerts, o.observe)
		}
	} else {
		// Neither attestation nor a CA vouches for the server: only for client-attests mode, where the
		// server validates us and we have nothing to protect from it.
		cfg.VerifyPeerCertificate = func([][]byte, [][]*x509.Certificate) error { return nil }
	}
	if issuer != nil {
		// Claims are an optimization for the server: without them the handshake runs in full.
		claims := o.claims
		if !o.claimsRead {
			var err error
			if claims, err = claimProtos(ctx, issuer); err != nil {
				o.log.Info("attesting without claimed measurements", zap.Error(err))
			}
		}
		cfg.NextProtos = append(cfg.NextProtos, claims...)
		if a, ok := issuer.(Activator); ok {
			id, err := a.Identity(ctx)
			if err != nil {
				return nil, fmt.Errorf("reading attestation identity: %w", err)
			}
			cfg.NextProtos = append(cfg.NextProtos, toALPN(alpnIdentity, id)...)
		}
		cfg.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			nonce, err := decodeCANonce(cri.AcceptableCAs)
			if err != nil {
				return nil, err
			}
			if challenge := decodeCAChallenge(cri.AcceptableCAs); challenge != nil {
				if a, ok := issuer.(Activator); ok {
					secret, err := a.Activate(cri.Context(), challenge)
					if err != nil {
						return nil, fmt.Errorf("activating attestation key: %w", err)
					}
					nonce = mixNonce(nonce, secret)
				}
			}
			return attestedCertificate(cri.Context(), issuer, o.attestKey, nonce)
		}
	}
	return cfg, nil
}

// peerHost is the rate limiting key of a connection: the remote IP without port.
func peerHost(c net.Conn) string {
	if c == nil || c.RemoteAddr() == nil {
		return ""
	}
	addr := c.RemoteAddr().String()
	if host, _, err := net.SplitHostPort(addr); err == nil {
		return host
	}
	return addr
}

// refusalConfig is the config of the pre-made refusal (ErrRateLimited): a plain TLS handshake.
func refusalConfig(certs *serverCerts) *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS13, CurvePreferences: probeCurves, Certificates: []tls.Certificate{*certs.refusal}}
}

// refuseClaims judges the measurements the client claims in its hello (judgeClaims) and, when the
// server's ClaimCheck refuses them, answers with a fatal access_denied alert before any handshake
// message of its own (refuseWithAlert): no key exchange, no signature, no certificate. It returns the
// error that ends the handshake, nil to go on. The reason stays with the server (its log, and what the
// ClaimCheck records); the client learns only that its claims were refused (ClaimVerdict).
func refuseClaims(ctx context.Context, o options, chi *tls.ClientHelloInfo, peer string) error {
	why := judgeClaims(ctx, o, peer, chi.SupportedProtos)
	if why == nil {
		return nil
	}
	o.log.Debug("refusing attestation: claimed measurements rejected", zap.String("peer", peer), zap.Error(why))
	if err := refuseWithAlert(chi.Conn); err != nil {
		return fmt.Errorf("refusing claimed measurements: %w", err)
	}
	return refusedClaims{why: why}
}
