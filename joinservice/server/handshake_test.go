package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/joinledger"
	"github.com/berth-k8s/berth/joinservice/ledger"
)

// TestClaimCheck: claims are judged as a whole, the ledger gets the full reason; claims never judge
// another variant. A refused node learns nothing of the policy: the refusal is a TLS alert that
// carries no words (atls TestClaimsRejectedBeforeAttesting; here TestAttestedJoin), so the reasons
// below stay with the joinservice.
func TestClaimCheck(t *testing.T) {
	zero := strings.Repeat("00", 32)
	tpm := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n  15: {expected: "+zero+", source: fresh node}\n"+
		"  7: {expected: "+zero+", mode: warn}\n")
	tdx := mustPolicy(t, "variant: tdx\nmeasurements:\n  4: {expected: "+strings.Repeat("00", 48)+", source: the image}\n")
	wrong := bytes.Repeat([]byte{0x9d}, 32)
	all := func(over map[uint32][]byte) attestation.Measurements {
		m := attestation.Measurements{}
		for i := range uint32(24) {
			m[i] = make([]byte, 32)
		}
		for i, v := range over {
			m[i] = v
		}
		return m
	}
	for name, tc := range map[string]struct {
		policy *policy.Policy
		claims attestation.Measurements
		ledger string // what the ledger's message names; empty: not refused
	}{
		"good claims":                        {policy: tpm, claims: all(nil)},
		"good claims, a warn index deviates": {policy: tpm, claims: all(map[uint32][]byte{7: wrong})},
		"only the enforced indices":          {policy: tpm, claims: attestation.Measurements{4: make([]byte, 32), 15: make([]byte, 32)}},
		"a wrong enforced index":             {policy: tpm, claims: all(map[uint32][]byte{4: wrong}), ledger: "index 4: expected " + zero},
		"an enforced index left out":         {policy: tpm, claims: attestation.Measurements{4: make([]byte, 32)}, ledger: "leave out enforced indices [15]"},
		"only an index the policy ignores":   {policy: tpm, claims: attestation.Measurements{0: wrong}, ledger: "leave out enforced indices [4 15]"},
		"a cluster of another variant":       {policy: tdx, claims: attestation.Measurements{4: wrong}},
	} {
		t.Run(name, func(t *testing.T) {
			j := &journal{}
			refused := measuredCheck(t, ClaimCheck(func() *policy.Policy { return tc.policy }, j, nil))(context.Background(), "198.51.100.20", tc.claims)
			if tc.ledger == "" {
				if refused != nil || len(j.all()) != 0 {
					t.Fatalf("refused: %v, ledger %+v", refused, j.all())
				}
				return
			}
			if refused == nil {
				t.Fatal("not refused")
			}
			if es := j.all(); len(es) != 1 || es[0].Peer != "198.51.100.20" || !strings.Contains(es[0].Message, tc.ledger) {
				t.Fatalf("ledger %+v, want the full reason %q for the peer", es, tc.ledger)
			}
		})
	}
	// A node claiming one random value at every index and one claiming only the indices the policy
	// does not judge are both refused, and a refusal is the same alert whatever the reason.
	check := measuredCheck(t, ClaimCheck(func() *policy.Policy { return tpm }, &journal{}, nil))
	random := all(nil)
	for i := range random {
		random[i] = bytes.Repeat([]byte{byte(i + 1)}, 32)
	}
	a, b := check(context.Background(), "198.51.100.21", random), check(context.Background(), "198.51.100.21", attestation.Measurements{0: wrong, 1: wrong})
	if a == nil || b == nil {
		t.Fatalf("refusals %v and %v: want both refused", a, b)
	}
}

// TestLedgerKinds: the ledger keeps refusals of evidence that took a TPM to make (and of peers whose
// attestation verified) apart from what anyone can send: an untrusted EK, a bad signature and a key
// not activated cost the peer no verified TPM operation.
func TestLedgerKinds(t *testing.T) {
	for reason, want := range map[string]string{
		ReasonNonceMismatch: joinledger.KindEvidence, ReasonKeyBinding: joinledger.KindEvidence,
		ReasonUntrustedRoot: joinledger.KindUnverified, ReasonBadSignature: joinledger.KindUnverified, ReasonNotActivated: joinledger.KindUnverified,
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

// TestClaimsDigest pins the ledger's digest of claims: SHA-256 over "index=hex(value);" by ascending
// index, as berth status shows it.
func TestClaimsDigest(t *testing.T) {
	m := attestation.Measurements{15: {0xab, 0x01}, 4: {0x00, 0xff}, 10: nil}
	want := sha256.Sum256([]byte("4=00ff;10=;15=ab01;"))
	if got := claimsDigest(m); got != hex.EncodeToString(want[:]) {
		t.Fatalf("claimsDigest = %s, want %x", got, want)
	}
}

// TestClaimVerdictsRemembered: the verdict on a set of claims is remembered per policy and per exact
// claims: a policy change judges again, claims differing in one byte are judged on their own, and the
// memory is bounded.
func TestClaimVerdictsRemembered(t *testing.T) {
	zero := strings.Repeat("00", 32)
	strict := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n")
	loose := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {anyOf: ["+zero+", "+strings.Repeat("9d", 32)+"], source: the image}\n")
	current := strict
	j := &journal{}
	check := measuredCheck(t, ClaimCheck(func() *policy.Policy { return current }, j, nil))
	ctx := context.Background()
	good, wrong := attestation.Measurements{4: make([]byte, 32)}, attestation.Measurements{4: bytes.Repeat([]byte{0x9d}, 32)}
	for range 3 {
		if check(ctx, "198.51.100.30", good) != nil || check(ctx, "198.51.100.30", wrong) == nil {
			t.Fatal("strict policy: want good claims accepted, wrong ones refused")
		}
	}
	if es := j.all(); len(es) != 3 || es[2].Message != es[0].Message || !strings.Contains(es[0].Message, "index 4") {
		t.Fatalf("ledger %+v: want 3 refusals with the same full reason", es)
	}
	// One byte differs: judged on its own.
	almost := attestation.Measurements{4: append(make([]byte, 31), 1)}
	if check(ctx, "198.51.100.30", almost) == nil {
		t.Fatal("claims one byte off the good ones accepted")
	}
	// The policy changes: what it accepts now is accepted, whatever was remembered.
	current = loose
	if err := check(ctx, "198.51.100.30", wrong); err != nil {
		t.Fatalf("after the policy change: %v", err)
	}
	current = strict
	// Bounded: more distinct claims than remembered are all judged right.
	for i := range maxClaimVerdicts + 10 {
		m := attestation.Measurements{4: make([]byte, 32), 5: {byte(i), byte(i >> 8)}}
		if check(ctx, "198.51.100.31", m) != nil {
			t.Fatalf("claims %d refused", i)
		}
	}
	if check(ctx, "198.51.100.30", wrong) == nil {
		t.Fatal("wrong claims accepted after the memory filled up")
	}
}

// measuredCheck calls check with m encoded as a node claims it.
func measuredCheck(t *testing.T, check atls.ClaimCheck) func(context.Context, string, attestation.Measurements) error {
	return func(ctx context.Context, peer string, m attestation.Measurements) error {
		claims, err := atls.ClaimsOf(m)
		if err != nil {
			t.Fatal(err)
		}
		return check(ctx, peer, claims)
	}
}

// TestRememberedRefusalIsTheSame: a refusal remembered reports what the first one did (reason, words,
// digest, an error that still names its cause) without judging again, and the memory is keyed by the
// exact claims: the verdict on one set of claims never answers for another, whichever was judged
// first.
func TestRememberedRefusalIsTheSame(t *testing.T) {
	zero := strings.Repeat("00", 32)
	p := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n")
	j := &journal{}
	check := measuredCheck(t, ClaimCheck(func() *policy.Policy { return p }, j, nil))
	ctx := context.Background()
	good := attestation.Measurements{4: make([]byte, 32)}
	wrong := attestation.Measurements{4: bytes.Repeat([]byte{0x9d}, 32)}
	first, again := check(ctx, "198.51.100.40", wrong), check(ctx, "198.51.100.41", wrong)
	if first == nil || again == nil || first.Error() != again.Error() || !errors.Is(again, attestation.ErrMeasurementMismatch) {
		t.Fatalf("refusals %v and %v: want the same verdict, naming a measurement mismatch", first, again)
	}
	if es := j.all(); len(es) != 2 || es[0].Message != es[1].Message || es[0].EvidenceSHA256 != es[1].EvidenceSHA256 ||
		es[1].Reason != ReasonMeasurements || es[1].Peer != "198.51.100.41" {
		t.Fatalf("ledger %+v: want two entries alike but for their peer", es)
	}
	// Good claims remembered first, then claims that share all but one byte with them: refused.
	for i := range 32 {
		if check(ctx, "198.51.100.42", good) != nil {
			t.Fatal("good claims refused")
		}
		off := attestation.Measurements{4: make([]byte, 32)}
		off[4][i] = 1
		if check(ctx, "198.51.100.42", off) == nil {
			t.Fatalf("claims off the good ones in byte %d passed", i)
		}
	}
	// Good claims plus an index the policy ignores: judged on their own, and pass.
	if err := check(ctx, "198.51.100.42", attestation.Measurements{4: make([]byte, 32), 9: {1}}); err != nil {
		t.Fatalf("good claims with one more index: %v", err)
	}
}

// TestMalformedClaimsRefused: claims whose encoding does not decode are refused and recorded as
// MALFORMED_EVIDENCE, remembered or not; they never pass.
func TestMalformedClaimsRefused(t *testing.T) {
	zero := strings.Repeat("00", 32)
	p := mustPolicy(t, "variant: tpm\nmeasurements:\n  4: {expected: "+zero+", source: the image}\n")
	j := &journal{}
	check := ClaimCheck(func() *policy.Policy { return p }, j, nil)
	good, err := atls.ClaimsOf(attestation.Measurements{4: make([]byte, 32)})
	if err != nil {
		t.Fatal(err)
	}
	for name, enc := range map[string][]byte{
		"cut short":            good.Encoded()[:len(good.Encoded())-1],
		"an index twice":       append(append([]byte(nil), good.Encoded()...), good.Encoded()...),
		"a length beyond them": {4, 200, 0},
	} {
		for range 2 {
			err := check(context.Background(), "198.51.100.50", atls.ClaimsEncoded(enc))
			if !errors.Is(err, attestation.ErrMalformed) {
				t.Fatalf("%s: %v, want a refusal as malformed", name, err)
			}
		}
	}
	if es := j.all(); len(es) != 6 || es[5].Reason != ReasonMalformed || es[5].Kind != joinledger.KindUnverified {
		t.Fatalf("ledger %+v: want six unverified MALFORMED_EVIDENCE entries", es)
	}
}
