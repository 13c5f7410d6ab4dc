package vtpm_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

func softTPM(t *testing.T, ca *vtpmtest.CA) *vtpmtest.SoftTPM {
	t.Helper()
	pcrs := map[uint32][]byte{}
	for i := range uint32(24) {
		pcrs[i] = make([]byte, 32)
	}
	s, err := vtpmtest.NewSoftTPM(ca, pcrs)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestIdentityCache: a remembered identity still has every quote checked, is keyed by its exact
// bytes, is verified again once its EK certificate expired, and the memory is bounded.
func TestIdentityCache(t *testing.T) {
	ctx := context.Background()
	ca, err := vtpmtest.NewCA("cache CA")
	if err != nil {
		t.Fatal(err)
	}
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.PEM()}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	s := softTPM(t, ca)
	issue := func(nonce string) []byte {
		raw, err := s.Issue(ctx, []byte("key"), []byte(nonce))
		if err != nil {
			t.Fatal(err)
		}
		return raw
	}
	if _, err := v.Validate(ctx, issue("one"), []byte("one")); err != nil {
		t.Fatalf("first contact: %v", err)
	}
	if n := vtpm.RememberedIdentities(v); n != 1 {
		t.Fatalf("remembers %d identities after one, want 1", n)
	}
	if _, err := v.Validate(ctx, issue("two"), []byte("two")); err != nil {
		t.Fatalf("repeat: %v", err)
	}

	// Known identity, forged quote: the signature is still checked.
	var doc vtpm.Document
	if err := json.Unmarshal(issue("three"), &doc); err != nil {
		t.Fatal(err)
	}
	doc.QuoteSignature[len(doc.QuoteSignature)-1] ^= 1
	forged, _ := json.Marshal(doc)
	if _, err := v.Validate(ctx, forged, []byte("three")); !errors.Is(err, attestation.ErrBadSignature) {
		t.Fatalf("forged quote of a known identity: got %v, want ErrBadSignature", err)
	}
	// Known AK and quote, another EK certificate (one byte differs): verified in full, refused.
	if err := json.Unmarshal(issue("four"), &doc); err != nil {
		t.Fatal(err)
	}
	doc.EKCert[len(doc.EKCert)-1] ^= 1
	forged, _ = json.Marshal(doc)
	if _, err := v.Validate(ctx, forged, []byte("four")); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("known AK with an altered EK certificate: got %v, want ErrUntrustedRoot", err)
	}

	// The EK certificate (valid 24 h) expired: the identity is verified again and refused.
	vtpm.SetClock(v, func() time.Time { return time.Now().Add(48 * time.Hour) })
	if _, err := v.Validate(ctx, issue("five"), []byte("five")); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("remembered identity whose EK certificate expired: got %v, want ErrUntrustedRoot", err)
	}
	vtpm.SetClock(v, time.Now)

	// Bounded: with room for 2, a third identity pushes one out.
	vtpm.LimitIdentities(v, 2)
	for range 3 {
		other := softTPM(t, ca)
		raw, err := other.Issue(ctx, nil, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.Validate(ctx, raw, []byte("n")); err != nil {
			t.Fatal(err)
		}
	}
	if n := vtpm.RememberedIdentities(v); n != 2 {
		t.Fatalf("remembers %d identities, want at most 2", n)
	}

	// Another policy is another validator: it remembers nothing, and this one does not trust the CA.
	otherCA, err := vtpmtest.NewCA("other CA")
	if err != nil {
		t.Fatal(err)
	}
	strict, err := vtpm.NewValidator(policyFor(t, [][]byte{otherCA.PEM()}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := strict.Validate(ctx, issue("six"), []byte("six")); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("validator of another policy: got %v, want ErrUntrustedRoot", err)
	}
}
