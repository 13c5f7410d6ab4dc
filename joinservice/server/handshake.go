package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
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
// quote from an untrusted or other connection's key, a replay, a bad signature, a failed activation.
// The ledger keeps them apart from the refusals anyone can cause (joinledger.KindEvidence).
var cryptographicReasons = map[string]bool{
	ReasonUntrustedRoot: true, ReasonNonceMismatch: true, ReasonKeyBinding: true, ReasonBadSignature: true, ReasonNotActivated: true,
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
// document: a node running the wrong image costs one plain TLS handshake. A refusal reaches the
// ledger (RPC "handshake", reason MEASUREMENT_MISMATCH, the digest of the claims as evidence) and the
// metrics. The node, not authenticated yet, learns which indices deviate but not the expected values.
// Claims that pass decide nothing: the node still proves its measurements, which the handler judges
// again.
func ClaimCheck(current func() *policy.Policy, j HandshakeJournal, obs Observer) atls.ClaimCheck {
	if obs == nil {
		obs = nopObserver{}
	}
	return func(_ context.Context, peer string, claims attestation.Measurements) *atls.Rejection {
		p := current()
		if p.Variant != vtpm.Variant {
			// Claims are TPM PCRs; a node of another variant than the cluster's is refused by the
			// handshake with UNKNOWN_VARIANT, not here.
			return nil
		}
		err := claimedViolations(p, claims)
		if err == nil {
			return nil
		}
		obs.Attempt("handshake", ledger.OutcomeRejected, ReasonMeasurements)
		j.Record(ledger.Entry{
			Time: time.Now().UTC(), Peer: peer, RPC: "handshake", Outcome: ledger.OutcomeRejected, Reason: ReasonMeasurements,
			Message: "claimed measurements: " + err.Error(), EvidenceSHA256: claimsDigest(claims), Kind: joinledger.KindUnverified,
		})
		return &atls.Rejection{Reason: ReasonMeasurements, Message: claimVerdict(err)}
	}
}

// claimedViolations judges the indices the node claimed and ignores the ones it did not claim: those
// are judged after the handshake, and naming them would tell any peer which indices the policy
// enforces.
func claimedViolations(p *policy.Policy, claims attestation.Measurements) error {
	_, err := p.Evaluate(claims)
	var mm *policy.MismatchError
	if !errors.As(err, &mm) {
		return err
	}
	var kept []policy.Violation
	for _, v := range mm.Violations {
		if _, claimed := claims[v.Index]; claimed {
			kept = append(kept, v)
		}
	}
	if len(kept) == 0 {
		return nil
	}
	return &policy.MismatchError{Violations: kept}
}

// claimVerdict is what an unauthenticated node learns from a refusal on its claims: which indices
// deviate and what it claimed there, never the policy's expected values or where they come from
// (the ledger has those; berth status shows them to the cluster's operator).
func claimVerdict(err error) string {
	var mm *policy.MismatchError
	if !errors.As(err, &mm) || len(mm.Violations) == 0 {
		return "claimed measurements do not satisfy the cluster policy"
	}
	parts := make([]string, len(mm.Violations))
	for i, v := range mm.Violations {
		parts[i] = fmt.Sprintf("index %d: claimed %s", v.Index, v.Actual)
	}
	return "claimed measurements do not satisfy the cluster policy (" + strings.Join(parts, "; ") +
		"); the expected values are in the cluster's join ledger (berth status)"
}

// claimsDigest is the hex SHA-256 over "index=value;" of every claimed measurement, ascending.
func claimsDigest(m attestation.Measurements) string {
	idx := make([]uint32, 0, len(m))
	for i := range m {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	h := sha256.New() // writes to a hash never fail
	for _, i := range idx {
		_, _ = fmt.Fprintf(h, "%d=%x;", i, m[i])
	}
	return hex.EncodeToString(h.Sum(nil))
}
