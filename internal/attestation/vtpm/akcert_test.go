package vtpm_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// TestCertifiedAK: a document whose AK a trusted AK CA certified passes ValidateCertified without an
// activation; every way around the certificate fails with ErrUntrustedRoot.
func TestCertifiedAK(t *testing.T) {
	ctx := context.Background()
	ca := vtpmtest.NewSwtpmCA(t)
	a, b := vtpmtest.StartSwtpm(t, ca), vtpmtest.StartSwtpm(t, ca)
	roots := [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}
	akCA, err := vtpm.NewAKCA(bytes.Repeat([]byte{7}, 32), "test cluster AK CA")
	if err != nil {
		t.Fatal(err)
	}
	again, err := vtpm.NewAKCA(bytes.Repeat([]byte{7}, 32), "test cluster AK CA")
	if err != nil || !bytes.Equal(again.Cert.Raw, akCA.Cert.Raw) {
		t.Fatalf("the same seed gave another CA certificate (%v)", err)
	}
	otherCA, err := vtpm.NewAKCA(bytes.Repeat([]byte{8}, 32), "test cluster AK CA")
	if err != nil {
		t.Fatal(err)
	}
	validator := func(akRoots ...[]byte) *vtpm.Validator {
		p := policyFor(t, roots, "")
		if len(akRoots) > 0 {
			var b strings.Builder
			b.WriteString("variant: tpm\ntrustRoots:\n")
			for _, r := range roots {
				b.WriteString("  - pem: |\n" + indentPEM(r))
			}
			b.WriteString("akRoots:\n")
			for _, r := range akRoots {
				b.WriteString("  - pem: |\n" + indentPEM(r))
			}
			p = parsePolicy(t, b.String())
		}
		v, err := vtpm.NewValidator(p, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	issA, issB := vtpm.NewIssuer(a.Open, zap.NewNop()), vtpm.NewIssuer(b.Open, zap.NewNop())
	nonce := []byte("nonce")
	uncertified, err := issA.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	if err := issA.CertifyAK(ctx, akCA.Certify); err != nil {
		t.Fatalf("CertifyAK: %v", err)
	}
	certified, err := issA.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	v := validator(akCA.PEM())
	if !v.CertifiesKeys() || validator().CertifiesKeys() {
		t.Fatal("CertifiesKeys does not follow the policy's akRoots")
	}
	if _, err := v.ValidateCertified(ctx, certified, nonce); err != nil {
		t.Fatalf("certified AK: %v", err)
	}
	if _, err := v.ValidateCertified(ctx, certified, nonce); err != nil {
		t.Fatalf("certified AK, remembered identity: %v", err)
	}
	if _, err := v.ValidateCertified(ctx, certified, []byte("other nonce")); !errors.Is(err, attestation.ErrNonceMismatch) {
		t.Fatalf("certified AK, replayed: got %v, want ErrNonceMismatch", err)
	}
	// An uncertified AK's quote for another nonce is no replay of a certified key: refused as untrusted.
	if _, err := v.ValidateCertified(ctx, uncertified, []byte("other nonce")); !errors.Is(err, attestation.ErrUntrustedRoot) || errors.Is(err, attestation.ErrNonceMismatch) {
		t.Fatalf("uncertified AK, another nonce: got %v, want ErrUntrustedRoot alone", err)
	}

	// b's AK in a document of b's, certified as if it lived with a's EK.
	rawB, err := issB.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	var docA, docB vtpm.Document
	if err := json.Unmarshal(certified, &docA); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(rawB, &docB); err != nil {
		t.Fatal(err)
	}
	withCert := func(d vtpm.Document, cert []byte) []byte {
		d.AKCert = cert
		out, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	crossCert, err := akCA.Certify(docB.AKPublic, docA.EKPublic)
	if err != nil {
		t.Fatal(err)
	}
	otherCert, err := otherCA.Certify(docB.AKPublic, docB.EKPublic)
	if err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		v   *vtpm.Validator
		doc []byte
	}{
		"no certificate":                     {v, uncertified},
		"policy without akRoots":             {validator(), certified},
		"certificate from an untrusted CA":   {v, withCert(docB, otherCert)},
		"certificate of another TPM's AK":    {v, withCert(docB, docA.AKCert)},
		"certificate naming another EK":      {v, withCert(docB, crossCert)},
		"certificate that is not a DER cert": {v, withCert(docB, []byte("garbage"))},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := tc.v.ValidateCertified(ctx, tc.doc, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
				t.Fatalf("got %v, want ErrUntrustedRoot", err)
			}
		})
	}
	// Plain validation ignores the certificate.
	if _, err := validator().Validate(ctx, certified, nonce); err != nil {
		t.Fatalf("Validate of a certified document: %v", err)
	}
}

// TestCertifiedAKStandsInForTheEKChain: for ValidateCertified a valid AK certificate is the word on
// the TPM's identity: a document from a TPM whose EK certificate chains to no trust root, its AK
// certified by the trusted AK CA, passes (the CA vouched for the EK). Plain Validate of the very same
// bytes, by the same validator after it remembered the identity, still checks the EK chain and fails;
// a pinned policy still requires the EK's pin; without the certificate the unrooted EK fails.
func TestCertifiedAKStandsInForTheEKChain(t *testing.T) {
	ctx := context.Background()
	trusted, err := vtpmtest.NewCA("trusted EK CA")
	if err != nil {
		t.Fatal(err)
	}
	rogue := vtpmtest.StartSwtpm(t, vtpmtest.NewSwtpmCA(t)) // its EK certificate's CA is in no policy
	akCA, err := vtpm.NewAKCA(bytes.Repeat([]byte{7}, 32), "test cluster AK CA")
	if err != nil {
		t.Fatal(err)
	}
	issuer := vtpm.NewIssuer(rogue.Open, zap.NewNop())
	nonce := []byte("nonce")
	uncertified, err := issuer.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	if err := issuer.CertifyAK(ctx, akCA.Certify); err != nil {
		t.Fatal(err)
	}
	certified, err := issuer.Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	var doc vtpm.Document
	if err := json.Unmarshal(certified, &doc); err != nil {
		t.Fatal(err)
	}
	ekPin := sha256.Sum256(doc.EKPublic)
	akRoots := "akRoots:\n  - pem: |\n" + indentPEM(akCA.PEM())
	newValidator := func(p string) *vtpm.Validator {
		v, err := vtpm.NewValidator(parsePolicy(t, p), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	rooted := "variant: tpm\ntrustRoots:\n  - pem: |\n" + indentPEM(trusted.PEM()) + akRoots
	pinned := func(pin []byte) string {
		return "variant: tpm\ntpm:\n  ekTrust: pinned\n  ekPublicSHA256:\n    - " + hex.EncodeToString(pin) + "\n" + akRoots
	}

	v := newValidator(rooted)
	for range 2 { // the second time from the remembered identity
		if _, err := v.ValidateCertified(ctx, certified, nonce); err != nil {
			t.Fatalf("ValidateCertified, certified AK of an unrooted EK: %v", err)
		}
		if _, err := v.Validate(ctx, certified, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
			t.Fatalf("Validate of the same document: got %v, want ErrUntrustedRoot (the EK chains to no trust root)", err)
		}
	}
	if _, err := v.ValidateCertified(ctx, uncertified, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("ValidateCertified without the certificate: got %v, want ErrUntrustedRoot", err)
	}
	if _, err := newValidator(pinned(ekPin[:])).ValidateCertified(ctx, certified, nonce); err != nil {
		t.Fatalf("ValidateCertified under a policy pinning the EK: %v", err)
	}
	if _, err := newValidator(pinned(bytes.Repeat([]byte{1}, 32))).ValidateCertified(ctx, certified, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("ValidateCertified under a policy pinning another EK: got %v, want ErrUntrustedRoot", err)
	}
}

// TestClaimsThenQuote: a quote after Claims starts from the claimed PCR values; when a PCR was
// extended in between, the document carries the new value and still validates.
func TestClaimsThenQuote(t *testing.T) {
	ctx := context.Background()
	open, ca, _ := newSimulator(t)
	issuer := vtpm.NewIssuer(open, zap.NewNop())
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.PEM()}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	for _, extendBetween := range []bool{false, true} {
		claims, err := issuer.Claims(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if extendBetween {
			extend(t, open, 16, "between claims and quote")
		}
		raw, err := issuer.Issue(ctx, nil, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		res, err := v.Validate(ctx, raw, []byte("n"))
		if err != nil {
			t.Fatalf("extended in between %v: %v", extendBetween, err)
		}
		if changed := !bytes.Equal(res.Measurements[16], claims[16]); changed != extendBetween {
			t.Fatalf("extended in between %v: PCR 16 quoted %x, claimed %x", extendBetween, res.Measurements[16], claims[16])
		}
	}
}

func parsePolicy(t *testing.T, doc string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(doc), "test-policy.yaml", nil)
	if err != nil {
		t.Fatalf("parsing policy: %v\n%s", err, doc)
	}
	return p
}
