package server

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// TestClaimCheck: only claimed indices are judged, an unauthenticated node learns neither the
// expected values nor which other indices the policy checks, and claims never judge another variant.
func TestClaimCheck(t *testing.T) {
	zero := strings.Repeat("00", 32)
	tpm := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {expected: "+zero+", source: fresh node}\n")
	tdx := mustPolicy(t, "variant: tdx\nmeasurements:\n  4: {expected: "+strings.Repeat("00", 48)+", source: the image}\n")
	wrong := bytes.Repeat([]byte{0x9d}, 32)
	for name, tc := range map[string]struct {
		policy  *policy.Policy
		claims  attestation.Measurements
		refused string // what the verdict names; empty: not refused
	}{
		"good claims":                        {policy: tpm, claims: attestation.Measurements{4: make([]byte, 32), 15: make([]byte, 32)}},
		"an index the policy does not check": {policy: tpm, claims: attestation.Measurements{0: wrong}},
		"a wrong claimed index":              {policy: tpm, claims: attestation.Measurements{4: wrong}, refused: "index 4: claimed 9d9d"},
		"a cluster of another variant":       {policy: tdx, claims: attestation.Measurements{4: wrong}},
	} {
		t.Run(name, func(t *testing.T) {
			j := &journal{}
			rej := ClaimCheck(func() *policy.Policy { return tc.policy }, j, nil)(context.Background(), "198.51.100.20", tc.claims)
			if tc.refused == "" {
				if rej != nil || len(j.all()) != 0 {
					t.Fatalf("refused: %v, ledger %+v", rej, j.all())
				}
				return
			}
			if rej == nil || rej.Reason != ReasonMeasurements || !strings.Contains(rej.Message, tc.refused) ||
				strings.Contains(rej.Message, "index 15") || strings.Contains(rej.Message, zero) {
				t.Fatalf("verdict %v, want one naming only %q", rej, tc.refused)
			}
			if es := j.all(); len(es) != 1 || es[0].Peer != "198.51.100.20" || !strings.Contains(es[0].Message, "expected "+zero) {
				t.Fatalf("ledger %+v, want the full verdict for the peer", es)
			}
		})
	}
}

// TestLedgerKinds: the ledger keeps refusals of evidence that took a TPM to make (and of peers whose
// attestation verified) apart from what anyone can send.
func TestLedgerKinds(t *testing.T) {
	for reason, want := range map[string]string{
		ReasonUntrustedRoot: joinledger.KindEvidence, ReasonNonceMismatch: joinledger.KindEvidence, ReasonKeyBinding: joinledger.KindEvidence,
		ReasonBadSignature: joinledger.KindEvidence, ReasonNotActivated: joinledger.KindEvidence,
		ReasonMalformed: joinledger.KindUnverified, ReasonUnknownVariant: joinledger.KindUnverified, ReasonNoEvidence: joinledger.KindUnverified,
		ReasonMeasurements: joinledger.KindUnverified, // in the handshake only claims are judged
	} {
		if got := handshakeKind(reason); got != want {
			t.Errorf("handshake refusal %s: kind %s, want %s", reason, got, want)
		}
	}
	for name, tc := range map[string]struct {
		e    ledger.Entry
		want string
	}{
		"accepted":                       {ledger.Entry{Outcome: ledger.OutcomeAccepted, EvidenceSHA256: "ab"}, joinledger.KindAccepted},
		"verified quote, wrong measures": {ledger.Entry{Outcome: ledger.OutcomeRejected, Reason: ReasonMeasurements, EvidenceSHA256: "ab"}, joinledger.KindEvidence},
		"verified quote, wrong role":     {ledger.Entry{Outcome: ledger.OutcomeRejected, Reason: ReasonRoleMismatch, EvidenceSHA256: "ab"}, joinledger.KindEvidence},
		"no evidence":                    {ledger.Entry{Outcome: ledger.OutcomeRejected, Reason: ReasonNoEvidence}, joinledger.KindUnverified},
		"unattested peer (insecure)":     {ledger.Entry{Outcome: ledger.OutcomeRejected, Reason: ReasonUnknownPeer}, joinledger.KindUnverified},
	} {
		if got := entryKind(tc.e); got != tc.want {
			t.Errorf("%s: kind %s, want %s", name, got, tc.want)
		}
	}
}
