package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// Reason codes of attestations refused in the TLS handshake, before any RPC (ledger entries with RPC
// "handshake").
const (
	ReasonUntrustedRoot   = "UNTRUSTED_ROOT"
	ReasonNonceMismatch   = "NONCE_MISMATCH"
	ReasonKeyBinding      = "KEY_BINDING"
	ReasonBadSignature    = "BAD_SIGNATURE"
	ReasonMalformed       = "MALFORMED_EVIDENCE"
	ReasonUnknownVariant  = "UNKNOWN_VARIANT"
	ReasonNotActivated    = "NOT_ACTIVATED"
	ReasonHandshakeFailed = "HANDSHAKE_FAILED"
)

// HandshakeJournal records handshake failures (ledger.Writer).
type HandshakeJournal interface {
	Record(ledger.Entry)
}

// handshakeReasons maps named validation errors to reason codes, most specific first.
var handshakeReasons = []struct {
	err    error
	reason string
}{
	{attestation.ErrUntrustedRoot, ReasonUntrustedRoot},
	{attestation.ErrNonceMismatch, ReasonNonceMismatch},
	{attestation.ErrKeyBinding, ReasonKeyBinding},
	{attestation.ErrBadSignature, ReasonBadSignature},
	{attestation.ErrMalformed, ReasonMalformed},
	{attestation.ErrUnknownVariant, ReasonUnknownVariant},
	{attestation.ErrMeasurementMismatch, ReasonMeasurements},
	{atls.ErrNotActivated, ReasonNotActivated},
	{atls.ErrNoAttestation, ReasonNoEvidence},
}

// cryptographicReasons are the handshake refusals of evidence that took a TPM to make: a genuine
// quote replayed from another handshake, or made for this handshake's nonce but bound to another
// connection's key. The ledger keeps them apart from the refusals anyone can cause
// (joinledger.KindEvidence). An untrusted EK (any software key with a CA of its own), a bad
// signature and a key that was not activated (a garbage certificate and no TPM at all) cost the peer
// nothing a TPM verified: counted as evidence, 250 addresses sending them evicted every replay and
// transplant the share exists to keep.
var cryptographicReasons = map[string]bool{
	ReasonNonceMismatch: true, ReasonKeyBinding: true,
}

// handshakeKind is the ledger kind of a handshake refusal with reason.
func handshakeKind(reason string) string {
	if cryptographicReasons[reason] {
		return joinledger.KindEvidence
	}
	return joinledger.KindUnverified
}

// HandshakeReason names a server handshake failure; ReasonHandshakeFailed when it is no attestation
// verdict (a client that gave up, a scanner, a wrong protocol).
func HandshakeReason(err error) string {
	for _, r := range handshakeReasons {
		if errors.Is(err, r.err) {
			return r.reason
		}
	}
	return ReasonHandshakeFailed
}

// RecordHandshakes wraps server transport credentials so that every attestation refused in the
// handshake reaches the join ledger (RPC "handshake", with its reason and message) and the metrics.
// Attestation verdicts are bounded by atls's handshake rate limit. Other handshake failures only
// count in the metrics (reason HANDSHAKE_FAILED): every join's identity probe ends as one (the client
// closes the probe connection once it has the identity), and anyone can cause them. The evidence
// digest is not known here: atls reports evidence to its observer without the peer's address.
func RecordHandshakes(creds credentials.TransportCredentials, j HandshakeJournal, obs Observer) credentials.TransportCredentials {
	if obs == nil {
		obs = nopObserver{}
	}
	return &recordingCreds{TransportCredentials: creds, journal: j, obs: obs}
}

type recordingCreds struct {
	credentials.TransportCredentials
	journal HandshakeJournal
	obs     Observer
}

func (c *recordingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err == nil {
		return conn, info, nil
	}
	peer := "unknown"
	if raw.RemoteAddr() != nil {
		if host, _, splitErr := net.SplitHostPort(raw.RemoteAddr().String()); splitErr == nil {
			peer = host
		}
	}
	reason := HandshakeReason(err)
	c.obs.Attempt("handshake", ledger.OutcomeRejected, reason)
	if reason != ReasonHandshakeFailed {
		c.journal.Record(ledger.Entry{
			Time: time.Now().UTC(), Peer: peer, RPC: "handshake", Outcome: ledger.OutcomeRejected, Reason: reason, Message: err.Error(),
			Kind: handshakeKind(reason),
		})
	}
	return conn, info, err
}

func (c *recordingCreds) Clone() credentials.TransportCredentials {
	return &recordingCreds{TransportCredentials: c.TransportCredentials.Clone(), journal: c.journal, obs: c.obs}
}

// ClaimCheck judges the measurements a joining node claims in its ClientHello (atls.Claimer) against
// the policy in force, before this replica quotes or activates for the node or validates its
// document: a node running the wrong image is refused with a TLS alert before any key exchange. A
// refusal reaches the ledger (RPC "handshake", reason MEASUREMENT_MISMATCH, the digest of the claims
// as evidence, the full verdict in the message; an unverified entry, aggregated per peer between the
// ledger's writes) and the metrics. Claims that pass decide nothing: the node still proves its
// measurements, which the handler judges again.
//
// Claims reveal nothing the policy does not publish. They are judged as a whole: claims that leave
// out an index the policy enforces are refused like claims that deviate, and the node is told only
// that its claims do not satisfy the policy (atls.ClaimVerdict: the alert says no more), never which
// index, which indices are judged or what is expected. Judging only the indices a node claims (or
// claims that leave one out not at all) would tell a node that claims one random value per index
// which indices the policy enforces.
func ClaimCheck(current func() *policy.Policy, j HandshakeJournal, obs Observer) atls.ClaimCheck {
	if obs == nil {
		obs = nopObserver{}
	}
	verdicts := &claimVerdicts{}
	return func(_ context.Context, peer string, claims atls.Claims) error {
		p := current()
		if p.Variant != vtpm.Variant {
			// Claims are TPM PCRs; a node of another variant than the cluster's is refused by the
			// handshake with UNKNOWN_VARIANT, not here.
			return nil
		}
		v := verdicts.judge(p, claims)
		if v.err == nil {
			return nil
		}
		obs.Attempt("handshake", ledger.OutcomeRejected, v.reason)
		j.Record(ledger.Entry{
			Time: time.Now().UTC(), Peer: peer, RPC: "handshake", Outcome: ledger.OutcomeRejected, Reason: v.reason,
			Message: v.message, EvidenceSHA256: v.digest, Kind: joinledger.KindUnverified,
		})
		return v.err
	}
}

// claimVerdicts remembers the verdicts on the claims judged last, keyed by the policy they were
// judged by and the claims' exact encoding (atls.Claims.Encoded): the nodes of one image claim the
// same values, so a join (or a flood of refusals) decodes, judges, words and digests each set of
// claims once per policy, and a refusal remembered costs a map lookup. At most maxClaimVerdicts are
// kept; when full, all are forgotten.
type claimVerdicts struct {
	mu sync.Mutex
	// policy is the policy the verdicts were judged by; another one forgets them.
	policy *policy.Policy
	m      map[string]claimVerdict // by the claims' encoding
}

// maxClaimVerdicts bounds the verdicts on claims a joinservice remembers.
const maxClaimVerdicts = 256

// claimVerdict is a judgement with everything a refusal reports, made once: the error (its text
// fixed), the ledger's reason, message and digest.
type claimVerdict struct {
	err     error
	reason  string // ReasonMeasurements, or ReasonMalformed for claims that do not decode
	message string // for the ledger: "claimed measurements: " and the reason
	digest  string // claimsDigest, the ledger's evidence; empty for claims that do not decode
}

// judge returns the verdict on claims under p.
func (c *claimVerdicts) judge(p *policy.Policy, claims atls.Claims) claimVerdict {
	c.mu.Lock()
	v, ok := c.m[string(claims.Encoded())]
	ok = ok && c.policy == p
	c.mu.Unlock()
	if ok {
		return v
	}
	v = judgeEncoded(p, claims)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.policy != p || len(c.m) >= maxClaimVerdicts {
		c.policy, c.m = p, map[string]claimVerdict{}
	}
	c.m[string(claims.Encoded())] = v
	return v
}

// judgeEncoded decodes and judges claims under p.
func judgeEncoded(p *policy.Policy, claims atls.Claims) claimVerdict {
	m, err := claims.Measurements()
	if err != nil {
		return claimVerdict{err: verdictError{text: err.Error(), cause: err}, reason: ReasonMalformed, message: err.Error()}
	}
	v := claimVerdict{digest: claimsDigest(m)}
	if err := judgeClaims(p, m); err != nil {
		text := err.Error()
		v.err, v.reason, v.message = verdictError{text: text, cause: err}, ReasonMeasurements, "claimed measurements: "+text
	}
	return v
}

// verdictError is a remembered verdict's error: its text is worded once, when the claims are judged,
// not again for every refusal that repeats it.
type verdictError struct {
	text  string
	cause error
}

func (e verdictError) Error() string { return e.text }
func (e verdictError) Unwrap() error { return e.cause }

// errUnclaimed names the enforced indices a node's claims leave out (for the ledger only).
type errUnclaimed []uint32

func (e errUnclaimed) Error() string {
	return fmt.Sprintf("the claims leave out enforced indices %v", []uint32(e))
}

// judgeClaims judges claims as a whole: every index the policy enforces must be claimed, and the
// claims must satisfy the policy.
func judgeClaims(p *policy.Policy, claims attestation.Measurements) error {
	var missing errUnclaimed
	for _, e := range p.Expectations {
		if _, ok := claims[e.Index]; !ok && e.Mode == policy.Enforce {
			missing = append(missing, e.Index)
		}
	}
	if len(missing) > 0 {
		return missing
	}
	_, err := p.Evaluate(claims)
	return err
}

// claimsDigest is the hex SHA-256 over "index=value;" of every claimed measurement, ascending.
func claimsDigest(m attestation.Measurements) string {
	idx := make([]uint32, 0, len(m))
	for i := range m {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	b := make([]byte, 0, len(m)*(3+2*sha256.Size+1)) // "%d=%x;" per index, without fmt
	for _, i := range idx {
		b = strconv.AppendUint(b, uint64(i), 10)
		b = append(b, '=')
		b = hex.AppendEncode(b, m[i])
		b = append(b, ';')
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
