package vtpm_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tpmsim"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// pinnedPolicy is a tpm policy that trusts the EKs with the given public-area digests, and no CA.
func pinnedPolicy(t *testing.T, digests ...[]byte) *policy.Policy {
	t.Helper()
	var b strings.Builder
	b.WriteString("variant: tpm\ntpm:\n  ekTrust: pinned\n  ekPublicSHA256:\n")
	for _, d := range digests {
		b.WriteString("    - " + hex.EncodeToString(d) + "\n")
	}
	p, err := policy.Parse([]byte(b.String()), "pinned.yaml", nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, b.String())
	}
	return p
}

// TestPinnedEK: a TPM without an EK certificate (as on AWS NitroTPM, whose EK public key only the
// EC2 API publishes) is trusted under tpm.ekTrust: pinned when its EK is pinned, and its AK still
// has to prove that it lives with that EK. Never without the pin, never by a certificate instead of
// the pin, and never for an AK from elsewhere.
func TestPinnedEK(t *testing.T) {
	ctx := context.Background()
	sim, err := tpmsim.New()
	if errors.Is(err, tpmsim.ErrUnavailable) {
		vtpmtest.Unavailable(t, "TPM simulator needs cgo")
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sim.Close() })
	// The simulator holds no EK certificate: the platform has no EK CA.
	nitro := vtpm.NewIssuer(sim.Open, zap.NewNop())
	pin, err := nitro.MachineIdentity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rawID, err := nitro.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	nonce := []byte("nonce-0123456789")
	plain, err := nitro.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatalf("a TPM without an EK certificate cannot issue: %v", err)
	}
	var doc vtpm.Document
	if err := json.Unmarshal(plain, &doc); err != nil {
		t.Fatal(err)
	}
	if len(doc.EKCert) != 0 {
		t.Fatal("the simulator's document carries an EK certificate")
	}

	// Genuine: pinned EK, the AK activated against it.
	v, err := vtpm.NewValidator(pinnedPolicy(t, bytes.Repeat([]byte{1}, 32), pin), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	challenge, secret, validate, err := v.Challenge(rawID)
	if err != nil {
		t.Fatal(err)
	}
	got, err := nitro.Activate(ctx, challenge)
	if err != nil {
		t.Fatal(err)
	}
	activated, err := nitro.Issue(ctx, nil, mixed(nonce, got))
	if err != nil {
		t.Fatal(err)
	}
	res, err := validate(ctx, activated, mixed(nonce, secret))
	if err != nil {
		t.Fatalf("pinned EK, activated AK: %v", err)
	}
	if !bytes.Equal(res.Identity, pin) {
		t.Errorf("identity %x, want the pin %x", res.Identity, pin)
	}
	if _, err := v.Validate(ctx, plain, nonce); err != nil {
		t.Fatalf("pinned EK, static checks: %v", err)
	}

	// A TPM whose EK certificate chains to a CA: with a pinned policy the certificate counts for
	// nothing; with a CA policy the simulator's document (no certificate) counts for nothing.
	swCA := vtpmtest.NewSwtpmCA(t)
	other := vtpm.NewIssuer(vtpmtest.StartSwtpm(t, swCA).Open, zap.NewNop())
	certified, err := other.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	byCA, err := vtpm.NewValidator(policyFor(t, [][]byte{swCA.RootPEM(t), swCA.IssuerPEM(t)}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := byCA.Validate(ctx, certified, nonce); err != nil {
		t.Fatalf("control: the certified TPM under its CA: %v", err)
	}

	impostor, err := vtpmtest.NewImpostor(doc.EKPublic, doc.PCRs)
	if err != nil {
		t.Fatal(err)
	}
	impostorDoc, err := impostor.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	// The other TPM's AK and quote next to the pinned EK: its creation record names its own EK.
	var transplanted vtpm.Document
	if err := json.Unmarshal(certified, &transplanted); err != nil {
		t.Fatal(err)
	}
	transplanted.EKCert, transplanted.EKPublic = nil, doc.EKPublic
	transplantedDoc, err := json.Marshal(transplanted)
	if err != nil {
		t.Fatal(err)
	}

	for name, tc := range map[string]struct {
		v   *vtpm.Validator
		doc []byte
	}{
		"EK not pinned":                             {mustValidator(t, pinnedPolicy(t, bytes.Repeat([]byte{1}, 32))), plain},
		"no EK certificate under a CA policy":       {byCA, plain},
		"a certified EK that is not pinned":         {v, certified},
		"AK from another TPM (its creation record)": {v, transplantedDoc},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := tc.v.Validate(ctx, tc.doc, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
				t.Fatalf("got %v, want ErrUntrustedRoot", err)
			}
		})
	}

	// A software AK whose self-signed creation record names the pinned EK passes every static check;
	// what stops it is the activation it cannot answer.
	if _, err := v.Validate(ctx, impostorDoc, nonce); err != nil {
		t.Fatalf("the impostor's document should pass the static checks (the activation is what refuses it): %v", err)
	}
	v2, err := vtpm.NewValidator(pinnedPolicy(t, pin), zap.NewNop()) // has not seen the genuine AK activated
	if err != nil {
		t.Fatal(err)
	}
	impID, err := impostor.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	challenge, secret, validate, err = v2.Challenge(impID)
	if err != nil || challenge == nil {
		t.Fatalf("challenge for the impostor: %x, %v", challenge, err)
	}
	if _, err := impostor.Activate(ctx, challenge); !errors.Is(err, vtpmtest.ErrBadCredential) {
		t.Fatalf("the impostor activated a credential made for the pinned EK: %v", err)
	}
	guess := make([]byte, len(secret))
	impostorDoc, err = impostor.Issue(ctx, nil, mixed(nonce, guess))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validate(ctx, impostorDoc, mixed(nonce, secret)); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("the impostor under the pinned EK's challenge: got %v, want ErrUntrustedRoot", err)
	}
}

func mustValidator(t *testing.T, p *policy.Policy) *vtpm.Validator {
	t.Helper()
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestPinnedPolicyShape: pinned and certificate trust are exclusive choices.
func TestPinnedPolicyShape(t *testing.T) {
	ca, err := vtpmtest.NewCA("CA")
	if err != nil {
		t.Fatal(err)
	}
	both, err := policy.Parse([]byte("variant: tpm\ntpm: {ekTrust: pinned, ekPublicSHA256: ["+strings.Repeat("ab", 32)+"]}\ntrustRoots:\n  - pem: |\n"+indentPEM(ca.PEM())), "both", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vtpm.NewValidator(both, zap.NewNop()); !errors.Is(err, policy.ErrInvalid) {
		t.Errorf("pinned EKs with trustRoots: got %v, want policy.ErrInvalid", err)
	}
	none, err := policy.Parse([]byte("variant: tpm\ntpm: {ekTrust: certificate}\n"), "none", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vtpm.NewValidator(none, zap.NewNop()); !errors.Is(err, policy.ErrInvalid) {
		t.Errorf("certificate trust without trustRoots: got %v, want policy.ErrInvalid", err)
	}
}
