package atls

import (
	"context"
	"encoding/asn1"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/berth-k8s/berth/internal/attestation"
)

// Claimed measurements make a rejection cheap. An attesting client that is a Claimer volunteers, in
// its ClientHello (ALPN entries "berth-m:..."), the measurements its document will carry. A validating
// server with a ClaimCheck judges them before it spends anything on the handshake: no quote of its
// own, no key activation, no challenge, no validation, and not even a key exchange or a signature. A
// client whose claims the check refuses gets a fatal TLS alert, access_denied, in the clear before any
// handshake message of the server's, and fails the handshake with a *Rejection (ClaimVerdict): the
// refusal costs the server reading a ClientHello and judging it.
//
// Claims are unauthenticated, and that is safe because they can only lead to a refusal: a client that
// lies about measurements it does not have only refuses itself, and a client whose claims pass (or
// whose claims cannot be decoded, or who makes none) still has to prove its measurements with a
// verified document, which the server judges in full. Identity probes carry the claims too, so a
// refused client costs the server one ClientHello.
//
// What it costs the client: the ClientHello is not encrypted, so the claimed values are visible to
// anyone watching the network between node and server (the document that proves them travels
// encrypted). They are measurements of the image and the boot, the same for every node of an image.
// And the verdict comes from a server that has not attested yet (anyone on the path can send an
// alert); a client treats it as information, never as proof, and only when it made claims: it names
// no index and no value, so it tells a prober nothing the policy does not publish. Servers that
// refused with a certificate carrying their verdict (OIDClaimRejection) before this protocol are
// still understood. A server that validates without attesting itself ignores claims.
// Claimer is an Issuer that can state the measurements its documents will carry without quoting
// (vtpm.Issuer reads its PCRs).
type Claimer interface {
	// Claims returns the measurements the next document will carry.
	Claims(ctx context.Context) (attestation.Measurements, error)
}

// ClaimCheck judges the measurements a client at peer (its IP address) claims; a non-nil error
// refuses the handshake. The error stays with the server (its log): the client learns only that its
// claims were refused.
type ClaimCheck func(ctx context.Context, peer string, claims Claims) error

// Claims are the measurements a client claims, as its ClientHello carries them: a check that
// remembers its verdicts keys them by Encoded and decodes (Measurements) only claims it has not
// judged yet. Equal encodings are equal claims; claims that decode alike but are encoded apart only
// get verdicts of their own.
type Claims struct {
	encoded []byte
}

// ClaimsOf encodes m as a client claims it.
func ClaimsOf(m attestation.Measurements) (Claims, error) {
	b, err := encodeClaims(m)
	if err != nil {
		return Claims{}, err
	}
	return Claims{encoded: b}, nil
}

// ClaimsEncoded are the claims whose encoding (as a client sends it, ClaimsOf) is b, decoded only when
// asked (Measurements); b is not copied.
func ClaimsEncoded(b []byte) Claims { return Claims{encoded: b} }

// Encoded is the claims' encoding as the client sent it; the caller must not change it.
func (c Claims) Encoded() []byte { return c.encoded }

// Measurements decodes the claims; claims that do not decode are attestation.ErrMalformed.
func (c Claims) Measurements() (attestation.Measurements, error) {
	m, err := decodeClaims(c.encoded)
	if err != nil {
		return nil, fmt.Errorf("claimed measurements: %w", err)
	}
	return m, nil
}

// WithClaimCheck makes a validating server judge the measurements clients claim before it attests,
// activates or validates (see Claimer).
func WithClaimCheck(c ClaimCheck) Option { return func(o *options) { o.claimCheck = c } }

// OIDClaimRejection marks a certificate that refuses a handshake on the client's claimed
// measurements; its value is the DER of rejectionValue. Servers refuse with an alert now
// (refuseWithAlert); clients still understand such a certificate.
var OIDClaimRejection = asn1.ObjectIdentifier{1, 3, 9901, 1, 4}

// ErrClaimsRejected means the server refused the handshake on the measurements this side claimed.
var ErrClaimsRejected = errors.New("attestation refused on claimed measurements")

// errRefusedClaims is the server's side of a refusal on claims: its handshake ends with it.
var errRefusedClaims = errors.New("refused the client's claimed measurements with a TLS alert")

// ClaimVerdictReason and ClaimVerdict are the Rejection a client reports when a server refuses its
// claims with an alert: all the alert says. Why is in the server's log and the cluster's join ledger.
const (
	ClaimVerdictReason = "MEASUREMENT_MISMATCH"
	ClaimVerdict       = "claimed measurements do not satisfy the cluster policy; the cluster's join ledger says why (berth status)"
)

// accessDeniedAlert is a TLS record (RFC 8446 5.1, 6) holding a fatal access_denied alert, in the
// clear as a server sends it before its ServerHello: content type 21, legacy version 3.3, length 2,
// level fatal (2), description access_denied (49).
var accessDeniedAlert = []byte{21, 3, 3, 0, 2, 2, 49}

// refuseWithAlert writes the access_denied alert on conn, the connection a server handshake runs on,
// which has not carried any byte from the server yet. On a serverConn, what crypto/tls writes after it
// (its own internal_error alert for the handshake that GetConfigForClient ends) is dropped.
func refuseWithAlert(conn net.Conn) error {
	if sc, ok := conn.(*serverConn); ok {
		return sc.refuse()
	}
	_, err := conn.Write(accessDeniedAlert)
	return err
}

// serverConn is the connection under a server's TLS handshake (Credentials.ServerHandshake): a
// refusal by alert writes the alert and ends what the connection sends. Only the handshake's
// goroutine writes to it before the handshake ends, so refused needs no lock.
type serverConn struct {
	net.Conn
	refused bool
}

func (c *serverConn) refuse() error {
	c.refused = true
	_, err := c.Conn.Write(accessDeniedAlert)
	return err
}

// Write drops everything after a refusal: the alert is all the client gets.
func (c *serverConn) Write(b []byte) (int, error) {
	if c.refused {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

// refusedByAlert says whether err is a handshake's failure on a fatal access_denied alert from the
// server (crypto/tls reports an alert it receives as a *net.OpError "remote error" whose Err is the
// alert, unexported, reading "tls: access denied").
func refusedByAlert(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "remote error" && op.Err != nil && op.Err.Error() == "tls: access denied"
}

// claimsVerdict is the error a client reports for a failed handshake: a Rejection (ClaimVerdict) when
// it made claims and the server refused them with an alert, else err itself. A client that made no
// claims reports the alert as it is: no verdict on claims it never made.
func claimsVerdict(err error, claimed bool) error {
	if claimed && refusedByAlert(err) {
		return &Rejection{Reason: ClaimVerdictReason, Message: ClaimVerdict}
	}
	return err
}

// Rejection is a refusal on claimed measurements, as the client reports it. Reason is a short code
// (e.g. MEASUREMENT_MISMATCH), Message the verdict: ClaimVerdict for a server's alert, or the words
// of a server that refused with a certificate (OIDClaimRejection). Such words come from a server that
// has not attested: Reason is reduced to [A-Z0-9_], Message to printable ASCII of at most
// maxShownRejectionMsg characters, and Error shows the message quoted, as the peer's words.
type Rejection struct {
	Reason  string
	Message string
}

const rejectionMarker = "attestation refused on claimed measurements: "

// Error names the verdict in a form ParseRejection finds again in flattened error text: the reason
// code, then the message quoted and escaped (strconv.Quote).
func (r *Rejection) Error() string {
	return rejectionMarker + r.Reason + ": the server, not attested, says " + strconv.Quote(r.Message)
}

// Is makes errors.Is(err, ErrClaimsRejected) hold.
func (r *Rejection) Is(target error) bool { return target == ErrClaimsRejected }

// ParseRejection finds a Rejection in the text of an error that lost its type on the way (gRPC
// reports a failed handshake as a status message, quoting the handshake's error once more).
func ParseRejection(text string) (*Rejection, bool) {
	for range 2 { // gRPC's "desc = %q" around the handshake error
		_, quoted, ok := strings.Cut(text, `desc = "`)
		if !ok {
			break
		}
		inner, err := strconv.QuotedPrefix(`"` + quoted)
		if err != nil {
			break
		}
		if text, err = strconv.Unquote(inner); err != nil {
			return nil, false
		}
	}
	_, rest, ok := strings.Cut(text, rejectionMarker)
	if !ok {
		return nil, false
	}
	reason, said, ok := strings.Cut(rest, ": the server, not attested, says ")
	if !ok || reason == "" || strings.Trim(reason, "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_") != "" {
		return nil, false
	}
	quoted, err := strconv.QuotedPrefix(said)
	if err != nil {
		return nil, false
	}
	msg, err := strconv.Unquote(quoted)
	if err != nil {
		return nil, false
	}
	return &Rejection{Reason: reason, Message: printable(truncate(msg, maxShownRejectionMsg))}, true
}

// rejectionValue is the ASN.1 value of OIDClaimRejection.
type rejectionValue struct {
	Reason  string `asn1:"utf8"`
	Message string `asn1:"utf8"`
}

const (
	alpnClaims   = "berth-m:"
	maxReasonLen = 64
	// maxShownRejectionMsg bounds the server's words a client reports.
	maxShownRejectionMsg = 160
)

// encodeClaims serializes measurements as (index, length, value) triples in ascending index order.
func encodeClaims(m attestation.Measurements) ([]byte, error) {
	idx := make([]uint32, 0, len(m))
	for i := range m {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	var out []byte
	for _, i := range idx {
		v := m[i]
		if i > 255 || len(v) > 255 {
			return nil, fmt.Errorf("claiming measurement %d of %d bytes: beyond what a claim carries", i, len(v))
		}
		out = append(out, byte(i), byte(len(v)))
		out = append(out, v...)
	}
	if len(out) > maxActivationBlob {
		return nil, fmt.Errorf("claiming %d bytes of measurements: more than %d", len(out), maxActivationBlob)
	}
	return out, nil
}

// decodeClaims parses encodeClaims's output; every index at most once.
func decodeClaims(b []byte) (attestation.Measurements, error) {
	if len(b) > maxActivationBlob {
		return nil, fmt.Errorf("%w: %d bytes of claims", attestation.ErrMalformed, len(b))
	}
	b = append([]byte(nil), b...)                  // one copy; the values are slices of it, capped
	m := make(attestation.Measurements, len(b)/34) // 24 SHA-256 PCRs are 24 triples of 34 bytes
	for len(b) > 0 {
		if len(b) < 2 || len(b) < 2+int(b[1]) {
			return nil, fmt.Errorf("%w: truncated claim", attestation.ErrMalformed)
		}
		i, n := uint32(b[0]), int(b[1])
		if _, dup := m[i]; dup {
			return nil, fmt.Errorf("%w: measurement %d claimed twice", attestation.ErrMalformed, i)
		}
		m[i] = b[2 : 2+n : 2+n]
		b = b[2+n:]
	}
	return m, nil
}

// claimsSent says whether a client's ALPN entries carry claims.
func claimsSent(protos []string) bool { return fromALPN(alpnClaims, protos) != nil }

// claimProtos returns the ALPN entries that volunteer issuer's claims; none when issuer makes none.
func claimProtos(ctx context.Context, issuer Issuer) ([]string, error) {
	c, ok := issuer.(Claimer)
	if !ok {
		return nil, nil
	}
	m, err := c.Claims(ctx)
	if err != nil {
		return nil, fmt.Errorf("reading claimed measurements: %w", err)
	}
	b, err := encodeClaims(m)
	if err != nil || len(b) == 0 {
		return nil, err
	}
	return toALPN(alpnClaims, b), nil
}

// judgeClaims applies the server's ClaimCheck to what the client claims in protos: the reason to
// refuse, nil to go on. The check decides on claims whose triples do not decode
// (Claims.Measurements: attestation.ErrMalformed); entries that are not base64 or exceed 4 KiB
// together count as no claims (fromALPN), and the handshake runs in full.
func judgeClaims(ctx context.Context, o options, peer string, protos []string) error {
	if o.claimCheck == nil {
		return nil
	}
	raw := fromALPN(alpnClaims, protos)
	if raw == nil {
		return nil
	}
	return o.claimCheck(ctx, peer, Claims{encoded: raw})
}

// refusedClaims is the error a server's handshake ends with when it refused the client's claims
// (errRefusedClaims). Its text is made only when someone reads it: the server's credentials answer a
// refusal with io.EOF and never do, and a refusal is the path a flood takes.
type refusedClaims struct{ why error }

func (e refusedClaims) Error() string { return errRefusedClaims.Error() + ": " + e.why.Error() }

// Unwrap gives errRefusedClaims only: the verdict was recorded by the ClaimCheck, and the handshake's
// error must not be taken for a validation's.
func (e refusedClaims) Unwrap() error { return errRefusedClaims }

// parseRejection turns a peer's OIDClaimRejection value into the error its side reports.
func parseRejection(value []byte) error {
	var v rejectionValue
	if rest, err := asn1.Unmarshal(value, &v); err != nil || len(rest) != 0 {
		return fmt.Errorf("%w: (unreadable verdict)", ErrClaimsRejected)
	}
	reason := strings.Map(func(r rune) rune {
		if r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' {
			return r
		}
		return -1
	}, truncate(v.Reason, maxReasonLen))
	if reason == "" {
		reason = "REJECTED"
	}
	return &Rejection{Reason: reason, Message: printable(truncate(v.Message, maxShownRejectionMsg))}
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// printable replaces control and non-ASCII characters of untrusted text.
func printable(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e {
			return '?'
		}
		return r
	}, s)
}
