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

	"go.uber.org/zap"
)

// Option configures the configs and credentials of this package.
type Option func(*options)

type options struct {
	limiter *Limiter
	observe func(Evidence, error)
	log     *zap.Logger
}

// WithLimiter sets the handshake rate limiter of an attesting server (default: NewLimiter(DefaultLimits)).
// Share one limiter between all listeners that use the same TPM.
func WithLimiter(l *Limiter) Option { return func(o *options) { o.limiter = l } }

// WithObserver calls f after every validation of a peer, with the evidence seen and the verdict.
func WithObserver(f func(Evidence, error)) Option { return func(o *options) { o.observe = f } }

// WithLogger sets the logger (default: no logging).
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.log = l } }

func buildOptions(opts []Option) options {
	o := options{log: zap.NewNop()}
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
	certs, err := newServerCerts()
	if err != nil {
		return nil, err
	}
	return serverConfig(issuer, validator, buildOptions(opts), certs), nil
}

// serverCerts are the certificates a server reuses: made once, because refusing must stay cheap.
type serverCerts struct {
	plain, refusal *tls.Certificate
}

func newServerCerts() (*serverCerts, error) {
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
	return &serverCerts{plain: plain, refusal: refusal}, nil
}

func serverConfig(issuer Issuer, validator Validator, o options, certs *serverCerts) *tls.Config {
	plain, refusal := certs.plain, certs.refusal
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
			cfg := &tls.Config{MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}}
			peer := peerHost(chi.Conn)
			if issuer == nil {
				cfg.Certificates = []tls.Certificate{*plain}
			} else {
				nonce, err := decodeSNINonce(chi.ServerName)
				if err != nil {
					o.log.Info("refusing handshake without attestation nonce", zap.String("peer", peer))
					return nil, err
				}
				if !o.limiter.Allow(peer) {
					o.log.Info("refusing attestation: rate limit", zap.String("peer", peer))
					cfg.Certificates = []tls.Certificate{*refusal}
					return cfg, nil
				}
				cert, err := attestedCertificate(chi.Context(), issuer, nonce)
				if err != nil {
					o.log.Error("issuing attestation failed", zap.String("peer", peer), zap.Error(err))
					return nil, errors.New("attestation unavailable")
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
				ctx := chi.Context()
				cfg.ClientCAs = pool
				cfg.ClientAuth = tls.RequireAnyClientCert
				cfg.VerifyPeerCertificate = func(rawCerts [][]byte, _ [][]*x509.Certificate) error {
					err := verifyPeer(ctx, validator, rawCerts, nonce, o.observe)
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

// NewClientConfig returns the TLS config for ONE client connection: it holds a fresh nonce, so build a
// new one per dial (Credentials does). With a validator the server must attest; with an issuer the
// client attests when the server asks.
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
		cfg.VerifyPeerCertificate = func(rawCerts [][]byte, _ [][]*x509.Certificate) error {
			return verifyPeer(ctx, validator, rawCerts, nonce, o.observe)
		}
	} else {
		// Neither attestation nor a CA vouches for the server: only for client-attests mode, where the
		// server validates us and we have nothing to protect from it.
		cfg.VerifyPeerCertificate = func([][]byte, [][]*x509.Certificate) error { return nil }
	}
	if issuer != nil {
		cfg.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			nonce, err := decodeCANonce(cri.AcceptableCAs)
			if err != nil {
				return nil, err
			}
			return attestedCertificate(cri.Context(), issuer, nonce)
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
