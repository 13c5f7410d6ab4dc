package atls

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// handshakeTimeout bounds a server-side handshake including the quote.
const handshakeTimeout = 30 * time.Second

// Credentials are gRPC transport credentials speaking attested TLS. Clients get a fresh nonce per
// connection; servers attest and/or validate per connection. Handlers read what the peer proved with
// PeerEvidence.
type Credentials struct {
	issuer    Issuer
	validator Validator
	opts      options
	// attestKey is the key of this side's attested certificates (one per credentials: each document
	// binds it with its connection's nonce).
	attestKey *ecdsa.PrivateKey
	// serverCerts makes the server's reused certificates at the first server handshake: clients
	// never need them (making them cost a node two key generations and two signatures per dial).
	serverCerts func() (*serverCerts, error)
	probed      *probeCache // server identities this client probed, by authority
}

// probeCache remembers the identity a probe returned per authority, so that a client that dials the
// same server again (a retry, a rejoin) skips the probe. An entry is dropped when a handshake with it
// fails: the server may have a new identity. At most maxProbed authorities are kept.
type probeCache struct {
	mu  sync.Mutex
	ids map[string][]byte
}

const maxProbed = 64

func (p *probeCache) get(authority string) []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ids[authority]
}

func (p *probeCache) put(authority string, id []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.ids) >= maxProbed {
		clear(p.ids)
	}
	p.ids[authority] = id
}

func (p *probeCache) drop(authority string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.ids, authority)
}

var _ credentials.TransportCredentials = (*Credentials)(nil)

// NewCredentials returns gRPC credentials. On a server: issuer attests to clients, validator requires
// clients to attest. On a client: validator requires the server to attest, issuer attests on request.
func NewCredentials(issuer Issuer, validator Validator, opts ...Option) (*Credentials, error) {
	attestKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generating TLS key: %w", err)
	}
	return &Credentials{issuer: issuer, validator: validator, opts: buildOptions(opts), attestKey: attestKey,
		serverCerts: sync.OnceValues(func() (*serverCerts, error) { return newServerCerts(attestKey) }),
		probed:      &probeCache{ids: map[string][]byte{}}}, nil
}

// AuthInfo is the credentials.AuthInfo of an attested TLS connection.
type AuthInfo struct {
	credentials.TLSInfo
	// Evidence is what the peer proved; nil when this side did not validate the peer.
	Evidence *Evidence
}

// AuthType returns "atls".
func (AuthInfo) AuthType() string { return "atls" }

// PeerEvidence returns the validated evidence of the gRPC peer in ctx.
func PeerEvidence(ctx context.Context) (*Evidence, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil, false
	}
	info, ok := p.AuthInfo.(AuthInfo)
	if !ok || info.Evidence == nil {
		return nil, false
	}
	return info.Evidence, true
}

// recorder keeps the evidence of the one validation in a handshake and forwards it to the observer.
type recorder struct {
	mu      sync.Mutex
	ev      *Evidence
	forward func(Evidence, error)
}

func (r *recorder) observe(ev Evidence, err error) {
	if err == nil {
		r.mu.Lock()
		r.ev = &ev
		r.mu.Unlock()
	}
	if r.forward != nil {
		r.forward(ev, err)
	}
}

func (r *recorder) evidence() *Evidence {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ev
}

// ClientHandshake runs the client side of attested TLS on rawConn.
// With a Challenger validator that certifies no keys it first probes the server's identity over a
// separate connection to authority, which must therefore be the server's HOST:PORT.
func (c *Credentials) ClientHandshake(ctx context.Context, authority string, rawConn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	rec := &recorder{forward: c.opts.observe}
	o := c.opts
	o.observe = rec.observe
	o.attestKey = c.attestKey
	if needsProbe(c.validator) {
		// Key activation needs the server's identity first: probe it over a connection of our own,
		// unless an earlier probe of this authority told it.
		claims, _ := claimProtos(ctx, c.issuer) // read once for both handshakes; optional
		o.claims, o.claimsRead = claims, true
		if o.peerIdentity = c.probed.get(authority); o.peerIdentity == nil {
			// From the connection's own address: the server charges the probe and the handshake it
			// pays for to one peer, and knows a node of its cluster by that address.
			var d net.Dialer
			if local, ok := rawConn.LocalAddr().(*net.TCPAddr); ok {
				d.LocalAddr = &net.TCPAddr{IP: local.IP, Zone: local.Zone}
			}
			probe, err := d.DialContext(ctx, "tcp", authority)
			if err != nil {
				return nil, nil, fmt.Errorf("connecting to %s for the identity probe: %w", authority, err)
			}
			if o.peerIdentity, err = probeIdentity(ctx, probe, claims); err != nil {
				return nil, nil, err
			}
			c.probed.put(authority, o.peerIdentity)
		}
	}
	cfg, err := NewClientConfig(ctx, c.issuer, c.validator, func(dst *options) { *dst = o })
	if err != nil {
		return nil, nil, err
	}
	conn := tls.Client(rawConn, cfg)
	if err := conn.HandshakeContext(ctx); err != nil {
		_ = conn.Close() // the handshake's error is the one to report
		if o.peerIdentity != nil {
			c.probed.drop(authority)
		}
		return nil, nil, fmt.Errorf("attested TLS handshake: %w", claimsVerdict(err, claimsSent(cfg.NextProtos)))
	}
	return conn, c.authInfo(conn, rec.evidence()), nil
}

// ServerHandshake runs the server side of attested TLS on rawConn.
func (c *Credentials) ServerHandshake(rawConn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	rec := &recorder{forward: c.opts.observe}
	o := c.opts
	o.observe = rec.observe
	if c.issuer == nil && c.validator == nil {
		return nil, nil, errors.New("attested TLS server: neither issuer nor validator")
	}
	certs, err := c.serverCerts()
	if err != nil {
		return nil, nil, fmt.Errorf("attested TLS server: %w", err)
	}
	cfg := serverConfig(c.issuer, c.validator, o, certs)
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	defer cancel()
	conn := tls.Server(&serverConn{Conn: rawConn}, cfg)
	if err := conn.HandshakeContext(ctx); err != nil {
		_ = conn.Close() // the handshake's error is the one to report
		if errors.Is(err, errRefusedClaims) {
			// Judged, logged and answered: io.EOF is what gRPC takes for a connection that ended
			// before its handshake and logs nothing about (for any other error it formats two log
			// lines, a tenth of what a refusal costs).
			return nil, nil, io.EOF
		}
		return nil, nil, fmt.Errorf("attested TLS handshake: %w", err)
	}
	return conn, c.authInfo(conn, rec.evidence()), nil
}

func (c *Credentials) authInfo(conn *tls.Conn, ev *Evidence) AuthInfo {
	return AuthInfo{
		TLSInfo: credentials.TLSInfo{
			State:          conn.ConnectionState(),
			CommonAuthInfo: credentials.CommonAuthInfo{SecurityLevel: credentials.PrivacyAndIntegrity},
		},
		Evidence: ev,
	}
}

// Info describes the protocol.
func (c *Credentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "atls"}
}

// Clone returns a copy sharing issuer, validator and rate limiter.
func (c *Credentials) Clone() credentials.TransportCredentials {
	cp := *c
	return &cp
}

// OverrideServerName is a no-op: the server name carries the nonce.
func (c *Credentials) OverrideServerName(string) error { return nil }
