package atls

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Key activation (TPM): a validator that is a Challenger only accepts an attester that proves, in the
// handshake, that its attestation key lives with its certified endorsement key. It needs the
// attester's identity before it can challenge:
//   - server attests: the client first fetches the server's identity with a probe handshake (a
//     certificate with OIDIdentity, no quote), then sends the challenge in its ClientHello (ALPN
//     entries "berth-c:..."); the server activates and mixes the recovered secret into the nonce.
//   - client attests: the client volunteers its identity in the ClientHello (ALPN "berth-i:..."); the
//     server puts the challenge next to the nonce among the acceptable CAs.
// An attester that cannot recover the secret produces a document for the wrong nonce, which the
// challenger's validation reports as attestation.ErrUntrustedRoot.

// Activator is an Issuer whose attestation key can be activated (vtpm.Issuer).
type Activator interface {
	// Identity returns what a Challenger needs to build a challenge.
	Identity(ctx context.Context) ([]byte, error)
	// Activate answers a challenge with the secret it recovers.
	Activate(ctx context.Context, challenge []byte) ([]byte, error)
}

// Challenger is a Validator that requires key activation (vtpm.Validator).
type Challenger interface {
	// Challenge returns a challenge for identity, the secret the attester must recover, and the
	// validation to use for its document. Challenge and secret are nil when the validator already
	// saw this identity's key activated; the document then binds the plain nonce.
	Challenge(identity []byte) (challenge, secret []byte, validate func(ctx context.Context, doc, nonce []byte) (attestation.Result, error), err error)
}

var (
	// OIDIdentity is the extension of a probe answer: the attester's activation identity.
	OIDIdentity = asn1.ObjectIdentifier{1, 3, 9901, 1, 3}
	// ErrNotActivated means the validator requires key activation and the peer did not take part.
	ErrNotActivated = errors.New("peer did not activate its attestation key")
)

const (
	probeServerName     = "probe" + sniSuffix
	alpnIdentity        = "berth-i:"
	alpnChallenge       = "berth-c:"
	alpnChunk           = 180 // bytes per ALPN entry before base64: 240 characters plus prefix < 255
	caChallengePrefix   = "berth-atls-challenge-"
	maxActivationBlob   = 4096
	activationNonceInfo = "berth atls activated nonce v1\x00"
)

var alpnEncoding = base64.RawURLEncoding

// mixNonce is the nonce an activated attester quotes over.
func mixNonce(nonce, secret []byte) []byte {
	h := sha256.New()
	h.Write([]byte(activationNonceInfo))
	h.Write(nonce)
	h.Write(secret)
	return h.Sum(nil)
}

// toALPN splits blob into ALPN protocol entries with prefix.
func toALPN(prefix string, blob []byte) []string {
	var out []string
	for len(blob) > 0 {
		n := min(alpnChunk, len(blob))
		out = append(out, prefix+alpnEncoding.EncodeToString(blob[:n]))
		blob = blob[n:]
	}
	return out
}

// fromALPN reassembles the blob with prefix from offered ALPN entries; nil when absent or invalid.
// It decodes into one buffer of the blob's size (a refused ClientHello's claims are most of what a
// refusal allocates).
func fromALPN(prefix string, protos []string) []byte {
	size := 0
	for _, p := range protos {
		if enc, ok := strings.CutPrefix(p, prefix); ok {
			size += alpnEncoding.DecodedLen(len(enc))
		}
	}
	if size == 0 || size > maxActivationBlob {
		return nil
	}
	out := make([]byte, 0, size)
	var chunk [255]byte // an ALPN entry is at most 255 bytes on the wire
	for _, p := range protos {
		enc, ok := strings.CutPrefix(p, prefix)
		if !ok {
			continue
		}
		src := chunk[:copy(chunk[:], enc)]
		if len(enc) > len(chunk) {
			src = []byte(enc)
		}
		n, err := alpnEncoding.Decode(out[len(out):cap(out)], src)
		if err != nil {
			return nil
		}
		out = out[:len(out)+n]
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// challengeCAPool returns the nonce pool plus a pseudo CA whose subject carries the challenge.
func addChallengeCA(pool *x509.CertPool, challenge []byte) error {
	subject, err := asn1.Marshal(pkix.Name{CommonName: caChallengePrefix + fmt.Sprintf("%x", challenge)}.ToRDNSequence())
	if err != nil {
		return fmt.Errorf("encoding challenge subject: %w", err)
	}
	pool.AddCert(&x509.Certificate{Raw: subject, RawSubject: subject})
	return nil
}

// decodeCAChallenge finds a challenge among the acceptable CAs; nil when there is none.
func decodeCAChallenge(acceptable [][]byte) []byte {
	for _, der := range acceptable {
		var rdn pkix.RDNSequence
		if rest, err := asn1.Unmarshal(der, &rdn); err != nil || len(rest) != 0 {
			continue
		}
		var name pkix.Name
		name.FillFromRDNSequence(&rdn)
		h, ok := strings.CutPrefix(name.CommonName, caChallengePrefix)
		if !ok || len(h) > 2*maxActivationBlob {
			continue
		}
		var b []byte
		if _, err := fmt.Sscanf(h, "%x", &b); err == nil && len(b) > 0 {
			return b
		}
	}
	return nil
}

// identityCertificate answers a probe: a certificate carrying the attester's identity, no quote. It
// is signed once per identity (a probe must stay cheap, also in a flood).
func identityCertificate(ctx context.Context, a Activator, certs *serverCerts) (*tls.Certificate, error) {
	id, err := a.Identity(ctx)
	if err != nil {
		return nil, fmt.Errorf("reading attestation identity: %w", err)
	}
	return certs.verdict(pkix.Extension{Id: OIDIdentity, Value: id})
}

// probeCurves is the key exchange of identity probes and refusals: X25519 alone. What they carry is
// public (the server's identity, the client's claims, a verdict), so they skip the post-quantum hybrid
// that Go prefers and that costs both sides an ML-KEM operation; the attested connection keeps it.
var probeCurves = []tls.CurveID{tls.X25519}

// errProbeDone ends a probe handshake once the identity is read.
var errProbeDone = errors.New("probe done")

// ProbeIdentity reads the activation identity of the attesting server on conn with a probe handshake
// and closes conn. It costs the server no quote. When issuer (may be nil) is a Claimer, the probe
// volunteers its claims, so that a validating server can refuse this client already here.
func ProbeIdentity(ctx context.Context, conn net.Conn, issuer Issuer) ([]byte, error) {
	claims, _ := claimProtos(ctx, issuer) // optional: without them the server judges the document later
	return probeIdentity(ctx, conn, claims)
}

// probeIdentity is ProbeIdentity with the claims already encoded.
func probeIdentity(ctx context.Context, conn net.Conn, claims []string) ([]byte, error) {
	var id []byte
	cfg := &tls.Config{
		MinVersion:         tls.VersionTLS13,
		CurvePreferences:   probeCurves,
		ServerName:         probeServerName,
		NextProtos:         claims,
		InsecureSkipVerify: true, //nolint:gosec // a probe only reads public identity; nothing is trusted
		VerifyPeerCertificate: func(rawCerts [][]byte, _ [][]*x509.Certificate) error {
			if len(rawCerts) == 0 {
				return ErrNoAttestation
			}
			cert, err := x509.ParseCertificate(rawCerts[0])
			if err != nil {
				return fmt.Errorf("%w: parsing probe answer: %w", attestation.ErrMalformed, err)
			}
			for _, e := range cert.Extensions {
				switch {
				case e.Id.Equal(OIDIdentity) && len(e.Value) <= maxActivationBlob:
					id = e.Value
					return errProbeDone
				case e.Id.Equal(OIDRefusal):
					return ErrRateLimited // the refusal's text is the peer's: not reported
				case e.Id.Equal(OIDClaimRejection):
					if len(claims) == 0 {
						return fmt.Errorf("%w: a verdict on claims this probe never made", attestation.ErrMalformed)
					}
					return parseRejection(e.Value)
				}
			}
			return ErrNotActivated
		},
	}
	tc := tls.Client(conn, cfg)
	err := tc.HandshakeContext(ctx)
	_ = tc.Close() // the probe connection is done either way: it only learns the identity
	if id != nil {
		return id, nil
	}
	return nil, fmt.Errorf("probing attestation identity: %w", claimsVerdict(err, len(claims) > 0))
}

// Dial connects to addr with attested TLS as a client: for a Challenger validator that certifies no
// keys it probes the server's identity over a first connection, then attests and activates over the
// second.
func Dial(ctx context.Context, dialer *net.Dialer, addr string, issuer Issuer, validator Validator, opts ...Option) (*tls.Conn, error) {
	if needsProbe(validator) {
		raw, err := dialer.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("connecting to %s: %w", addr, err)
		}
		claims, _ := claimProtos(ctx, issuer) // read once for both handshakes; optional
		id, err := probeIdentity(ctx, raw, claims)
		if err != nil {
			return nil, err
		}
		opts = append(opts, WithPeerIdentity(id), withClaims(claims))
	}
	cfg, err := NewClientConfig(ctx, issuer, validator, opts...)
	if err != nil {
		return nil, err
	}
	raw, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", addr, err)
	}
	conn := tls.Client(raw, cfg)
	if err := conn.HandshakeContext(ctx); err != nil {
		_ = conn.Close() // the handshake's error is the one to report
		return nil, fmt.Errorf("attested TLS handshake with %s: %w", addr, claimsVerdict(err, claimsSent(cfg.NextProtos)))
	}
	return conn, nil
}
