package vtpm_test

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tpmsim"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/nodelock"
)

// newSimulator returns the reference simulator with an EK certificate from a fresh CA.
func newSimulator(t testing.TB) (vtpm.OpenFunc, *vtpmtest.CA, *tpmsim.Simulator) {
	t.Helper()
	sim, err := tpmsim.New()
	if errors.Is(err, tpmsim.ErrUnavailable) {
		vtpmtest.Unavailable(t, "TPM simulator needs cgo")
	}
	if err != nil {
		t.Fatalf("starting simulator: %v", err)
	}
	t.Cleanup(func() { _ = sim.Close() })
	ca, err := vtpmtest.NewCA("test EK CA")
	if err != nil {
		t.Fatal(err)
	}
	if err := vtpmtest.ProvisionEKCert(t.Context(), sim.Open, ca); err != nil {
		t.Fatalf("provisioning EK certificate: %v", err)
	}
	return sim.Open, ca, sim
}

// policyFor builds a tpm policy trusting rootsPEM with expectations given as YAML lines.
func policyFor(t testing.TB, rootsPEM [][]byte, measurements string) *policy.Policy {
	t.Helper()
	var b strings.Builder
	b.WriteString("variant: tpm\n")
	if measurements != "" {
		b.WriteString("measurements:\n" + measurements)
	}
	b.WriteString("trustRoots:\n")
	for _, r := range rootsPEM {
		b.WriteString("  - pem: |\n")
		for _, line := range strings.Split(strings.TrimSpace(string(r)), "\n") {
			b.WriteString("      " + line + "\n")
		}
	}
	p, err := policy.Parse([]byte(b.String()), "test-policy.yaml", nil)
	if err != nil {
		t.Fatalf("parsing policy: %v\n%s", err, b.String())
	}
	return p
}

func TestRoundTripSimulator(t *testing.T) {
	open, ca, _ := newSimulator(t)
	otherCA, err := vtpmtest.NewCA("other CA")
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, open, [][]byte{ca.PEM()}, [][]byte{otherCA.PEM()})
}

func TestRoundTripSwtpm(t *testing.T) {
	ca := vtpmtest.NewSwtpmCA(t)
	sw := vtpmtest.StartSwtpm(t, ca)
	otherCA, err := vtpmtest.NewCA("other CA")
	if err != nil {
		t.Fatal(err)
	}
	roundTrip(t, sw.Open, [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}, [][]byte{otherCA.PEM()})
}

// roundTrip issues on open's TPM and validates: the good case, then every named failure.
func roundTrip(t *testing.T, open vtpm.OpenFunc, roots, untrusted [][]byte) {
	ctx := context.Background()
	log := zap.NewNop()
	issuer := vtpm.NewIssuer(open, log)
	userData, nonce := []byte("tls key hash"), []byte("nonce-0123456789abcdef0123456789")

	raw, err := issuer.Issue(ctx, userData, nonce)
	if err != nil {
		t.Fatalf("Issue: %v", err)
	}
	var doc vtpm.Document
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	pcr0 := hex.EncodeToString(doc.PCRs[0])
	good := policyFor(t, roots, fmt.Sprintf("  0: {expected: %q}\n  15: {expected: %q}\n", pcr0, strings.Repeat("00", 32)))
	v, err := vtpm.NewValidator(good, log)
	if err != nil {
		t.Fatal(err)
	}
	res, err := v.Validate(ctx, raw, nonce)
	if err != nil {
		t.Fatalf("Validate: %v", err)
	}
	if !bytes.Equal(res.UserData, userData) || len(res.Measurements) != 24 {
		t.Fatalf("got user data %q and %d measurements", res.UserData, len(res.Measurements))
	}

	// A second issue reuses the AK and still validates.
	raw2, err := issuer.Issue(ctx, userData, []byte("second nonce"))
	if err != nil {
		t.Fatalf("second Issue: %v", err)
	}
	if _, err := v.Validate(ctx, raw2, []byte("second nonce")); err != nil {
		t.Fatalf("second Validate: %v", err)
	}

	mutate := func(f func(d *vtpm.Document)) []byte {
		var d vtpm.Document
		if err := json.Unmarshal(raw, &d); err != nil {
			t.Fatal(err)
		}
		f(&d)
		out, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	warnPolicy := policyFor(t, roots, fmt.Sprintf("  0: {expected: %q, mode: warn}\n", strings.Repeat("ab", 32)))
	testCases := map[string]struct {
		policy  *policy.Policy
		doc     []byte
		nonce   []byte
		wantErr error
	}{
		"PCR mismatch": {
			policy: policyFor(t, roots, fmt.Sprintf("  0: {expected: %q}\n", strings.Repeat("ab", 32))),
			doc:    raw, nonce: nonce, wantErr: attestation.ErrMeasurementMismatch,
		},
		"replayed with another nonce": {doc: raw, nonce: []byte("a fresh nonce"), wantErr: attestation.ErrNonceMismatch},
		"user data swapped":           {doc: mutate(func(d *vtpm.Document) { d.UserData = []byte("other key") }), nonce: nonce, wantErr: attestation.ErrNonceMismatch},
		// A quote for another nonce counts as a replay only when the AK signed it and the EK is
		// trusted: otherwise anyone could make "replays" without a TPM.
		"forged quote for another nonce": {
			doc:   mutate(func(d *vtpm.Document) { d.QuoteSignature[len(d.QuoteSignature)-1] ^= 1 }),
			nonce: []byte("a fresh nonce"), wantErr: attestation.ErrBadSignature,
		},
		"untrusted EK, another nonce": {policy: policyFor(t, untrusted, ""), doc: raw, nonce: []byte("a fresh nonce"), wantErr: attestation.ErrUntrustedRoot},
		"EK CA not trusted":           {policy: policyFor(t, untrusted, ""), doc: raw, nonce: nonce, wantErr: attestation.ErrUntrustedRoot},
		"EK certificate removed":      {doc: mutate(func(d *vtpm.Document) { d.EKCert = nil }), nonce: nonce, wantErr: attestation.ErrUntrustedRoot},
		"AK creation record forged": {
			doc: mutate(func(d *vtpm.Document) {
				d.AKCreationData = append([]byte(nil), d.AKCreationData...)
				d.AKCreationData[len(d.AKCreationData)-3] ^= 1
			}),
			nonce: nonce, wantErr: attestation.ErrUntrustedRoot,
		},
		"PCR value tampered": {
			doc:   mutate(func(d *vtpm.Document) { d.PCRs[0] = bytes.Repeat([]byte{0xab}, 32) }),
			nonce: nonce, wantErr: attestation.ErrBadSignature,
		},
		"quote signature tampered": {
			doc:   mutate(func(d *vtpm.Document) { d.QuoteSignature[len(d.QuoteSignature)-1] ^= 1 }),
			nonce: nonce, wantErr: attestation.ErrBadSignature,
		},
		"quote not generated by a TPM": {
			doc:   mutate(func(d *vtpm.Document) { d.Quote[0] ^= 1 }),
			nonce: nonce, wantErr: attestation.ErrMalformed,
		},
		"quote with trailing bytes": {
			doc:   mutate(func(d *vtpm.Document) { d.Quote = append(d.Quote, 0) }),
			nonce: nonce, wantErr: attestation.ErrMalformed,
		},
		"truncated":        {doc: raw[:len(raw)/2], nonce: nonce, wantErr: attestation.ErrMalformed},
		"garbage":          {doc: []byte("\x00\x01garbage"), nonce: nonce, wantErr: attestation.ErrMalformed},
		"empty":            {doc: nil, nonce: nonce, wantErr: attestation.ErrMalformed},
		"unknown variant":  {doc: mutate(func(d *vtpm.Document) { d.Variant = "sev-snp" }), nonce: nonce, wantErr: attestation.ErrUnknownVariant},
		"warn only passes": {policy: warnPolicy, doc: raw, nonce: nonce},
	}
	for name, tc := range testCases {
		t.Run(name, func(t *testing.T) {
			val := v
			if tc.policy != nil {
				if val, err = vtpm.NewValidator(tc.policy, log); err != nil {
					t.Fatal(err)
				}
			}
			res, err := val.Validate(ctx, tc.doc, tc.nonce)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				if len(res.Warnings) != 1 {
					t.Fatalf("got warnings %q, want one", res.Warnings)
				}
				return
			}
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("got error %v, want %v", err, tc.wantErr)
			}
		})
	}
}

// TestAKFromAnotherTPM transplants the AK and quote of one TPM next to the EK certificate of another.
func TestAKFromAnotherTPM(t *testing.T) {
	ctx := context.Background()
	ca := vtpmtest.NewSwtpmCA(t)
	a, b := vtpmtest.StartSwtpm(t, ca), vtpmtest.StartSwtpm(t, ca)
	nonce := []byte("nonce")
	rawA, err := vtpm.NewIssuer(a.Open, zap.NewNop()).Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	rawB, err := vtpm.NewIssuer(b.Open, zap.NewNop()).Issue(ctx, nil, nonce)
	if err != nil {
		t.Fatal(err)
	}
	var docA, docB vtpm.Document
	if err := json.Unmarshal(rawA, &docA); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(rawB, &docB); err != nil {
		t.Fatal(err)
	}
	docB.EKCert, docB.EKPublic = docA.EKCert, docA.EKPublic
	forged, err := json.Marshal(docB)
	if err != nil {
		t.Fatal(err)
	}
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Validate(ctx, rawA, nonce); err != nil {
		t.Fatalf("genuine document: %v", err)
	}
	if _, err := v.Validate(ctx, forged, nonce); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("got %v, want ErrUntrustedRoot", err)
	}
}

func TestLockRegister(t *testing.T) {
	open, _, sim := newSimulator(t)
	ctx := context.Background()
	lock := vtpm.NewLockRegister(open, vtpm.DefaultLockPCR)
	if got, err := lock.Bootstrapped(ctx); err != nil || got {
		t.Fatalf("fresh TPM: Bootstrapped = %v, %v; want false", got, err)
	}
	clusterID := []byte("cluster-id-0123456789abcdef01234")
	if err := lock.MarkBootstrapped(ctx, clusterID); err != nil {
		t.Fatalf("MarkBootstrapped: %v", err)
	}
	if got, err := lock.Bootstrapped(ctx); err != nil || !got {
		t.Fatalf("after mark: Bootstrapped = %v, %v; want true", got, err)
	}
	if err := lock.MarkBootstrapped(ctx, clusterID); !errors.Is(err, vtpm.ErrLockTaken) {
		t.Fatalf("second mark: got %v, want ErrLockTaken", err)
	}
	// The quoted PCR holds the value a verifier computes from the cluster ID.
	raw, err := vtpm.NewIssuer(open, zap.NewNop()).Issue(ctx, nil, []byte("n"))
	if err != nil {
		t.Fatal(err)
	}
	var doc vtpm.Document
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if want := vtpm.ExpectedLockValue(clusterID); !bytes.Equal(doc.PCRs[vtpm.DefaultLockPCR], want) {
		t.Fatalf("PCR %d = %x, want %x", vtpm.DefaultLockPCR, doc.PCRs[vtpm.DefaultLockPCR], want)
	}
	// A reboot resets it.
	if err := sim.Reset(); err != nil {
		t.Fatal(err)
	}
	if got, err := lock.Bootstrapped(ctx); err != nil || got {
		t.Fatalf("after reset: Bootstrapped = %v, %v; want false", got, err)
	}
}

func TestOpenerFromSpec(t *testing.T) {
	for _, spec := range []string{"", "tcp:nohostport"} {
		if _, err := vtpm.OpenerFromSpec(spec); err == nil {
			t.Errorf("OpenerFromSpec(%q) succeeded", spec)
		}
	}
	for _, spec := range []string{"/dev/tpmrm0", "tcp:127.0.0.1:2321", "unix:/run/swtpm.sock"} {
		if _, err := vtpm.OpenerFromSpec(spec); err != nil {
			t.Errorf("OpenerFromSpec(%q): %v", spec, err)
		}
	}
}

func FuzzParseDocument(f *testing.F) {
	f.Add([]byte(`{"variant":"tpm","akPublic":"AA==","quote":"AA==","quoteSignature":"AA==","pcrs":{"0":"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="}}`))
	f.Add([]byte(`{"variant":"tdx"}`))
	f.Add([]byte(`[]`))
	p, err := policy.Parse([]byte("variant: tpm\ntrustRoots:\n  - pem: |\n"+indentPEM(mustCA(f).PEM())), "fuzz", nil)
	if err != nil {
		f.Fatal(err)
	}
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		_, err := v.Validate(context.Background(), data, []byte("nonce"))
		if err == nil {
			t.Fatal("validated a fuzzed document")
		}
		for _, want := range []error{attestation.ErrMalformed, attestation.ErrUnknownVariant, attestation.ErrNonceMismatch,
			attestation.ErrBadSignature, attestation.ErrUntrustedRoot, attestation.ErrMeasurementMismatch} {
			if errors.Is(err, want) {
				return
			}
		}
		t.Fatalf("error %v is not a named validation error", err)
	})
}

func mustCA(f *testing.F) *vtpmtest.CA {
	ca, err := vtpmtest.NewCA("fuzz CA")
	if err != nil {
		f.Fatal(err)
	}
	return ca
}

func indentPEM(b []byte) string {
	var s strings.Builder
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		s.WriteString("      " + line + "\n")
	}
	return s.String()
}

func TestAKReplacedByAnotherIssuer(t *testing.T) {
	open, ca, _ := newSimulator(t)
	ctx := context.Background()
	a, b := vtpm.NewIssuer(open, zap.NewNop()), vtpm.NewIssuer(open, zap.NewNop())
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.PEM()}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	for i, iss := range []*vtpm.Issuer{a, b, a} {
		raw, err := iss.Issue(ctx, nil, []byte("n"))
		if err != nil {
			t.Fatalf("issue %d: %v", i, err)
		}
		if _, err := v.Validate(ctx, raw, []byte("n")); err != nil {
			t.Fatalf("validate %d: %v", i, err)
		}
	}
}

func benchIssueValidate(b *testing.B, open vtpm.OpenFunc, roots [][]byte) {
	ctx := context.Background()
	issuer := vtpm.NewIssuer(open, zap.NewNop())
	v, err := vtpm.NewValidator(policyFor(b, roots, fmt.Sprintf("  15: {expected: %q}\n", strings.Repeat("00", 32))), zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	nonce := []byte("benchmark nonce")
	raw, err := issuer.Issue(ctx, nil, nonce) // creates the AK once
	if err != nil {
		b.Fatal(err)
	}
	b.Run("issue", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if _, err := issuer.Issue(ctx, nil, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
	// What a node spends on the claims it volunteers in every handshake (all a refused node spends
	// on its TPM): reading the PCRs it quotes. With swtpm, cpu-us/op is this process's side alone.
	b.Run("claims", func(b *testing.B) {
		defer reportCPU(b)()
		for i := 0; i < b.N; i++ {
			if _, err := issuer.Claims(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
	// A validator that has never seen this TPM (a new process, or a reloaded policy): it checks the
	// EK chain and the AK's creation record.
	b.Run("validate-first-contact", func(b *testing.B) {
		b.ReportMetric(float64(len(raw)), "doc-bytes")
		fresh := make([]*vtpm.Validator, b.N)
		for i := range fresh {
			if fresh[i], err = vtpm.NewValidator(v.Policy(), zap.NewNop()); err != nil {
				b.Fatal(err)
			}
		}
		b.ResetTimer()
		defer reportCPU(b)()
		for i := 0; i < b.N; i++ {
			if _, err := fresh[i].Validate(ctx, raw, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The same validator again: a node it has validated before (a joinservice's repeat customer).
	b.Run("validate-repeat", func(b *testing.B) {
		b.ReportMetric(float64(len(raw)), "doc-bytes")
		if _, err := v.Validate(ctx, raw, nonce); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		defer reportCPU(b)()
		for i := 0; i < b.N; i++ {
			if _, err := v.Validate(ctx, raw, nonce); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("challenge", func(b *testing.B) {
		id, err := issuer.Identity(ctx)
		if err != nil {
			b.Fatal(err)
		}
		for i := 0; i < b.N; i++ {
			if _, _, _, err := v.Challenge(id); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("activate", func(b *testing.B) {
		id, err := issuer.Identity(ctx)
		if err != nil {
			b.Fatal(err)
		}
		challenge, _, _, err := v.Challenge(id)
		if err != nil {
			b.Fatal(err)
		}
		for i := 0; i < b.N; i++ {
			if _, err := issuer.Activate(ctx, challenge); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("validate-rejected-nonce", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if _, err := v.Validate(ctx, raw, []byte("other")); !errors.Is(err, attestation.ErrNonceMismatch) {
				b.Fatal(err)
			}
		}
	})
}

// reportCPU reports the process's CPU time per iteration (user + system, all threads) as cpu-us/op
// when the returned function runs: on a shared machine wall time per op grows with the load, the
// CPU an op takes much less.
func reportCPU(b *testing.B) func() {
	start := processCPU()
	return func() {
		b.ReportMetric(float64(processCPU()-start)/float64(b.N)/1e3, "cpu-us/op")
	}
}

// processCPU is the CPU time this process has used, in nanoseconds.
func processCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// BenchmarkSimulator prints issue and validate latency on the reference simulator.
func BenchmarkSimulator(b *testing.B) {
	open, ca, _ := newSimulator(b)
	benchIssueValidate(b, open, [][]byte{ca.PEM()})
}

// BenchmarkSwtpm prints issue and validate latency on swtpm over a unix socket.
func BenchmarkSwtpm(b *testing.B) {
	ca := vtpmtest.NewSwtpmCA(b)
	sw := vtpmtest.StartSwtpm(b, ca)
	benchIssueValidate(b, sw.Open, [][]byte{ca.RootPEM(b), ca.IssuerPEM(b)})
}

// TestNodeLockMarker wires the lock register into nodelock's marker seam: of many racing callers
// exactly one takes the lock, and the PCR holds the cluster ID exactly once.
func TestNodeLockMarker(t *testing.T) {
	open, _, _ := newSimulator(t)
	ctx := context.Background()
	reg := vtpm.NewLockRegister(open, vtpm.DefaultLockPCR)
	lock := nodelock.New(reg)
	clusterID := []byte("cluster")
	var wg sync.WaitGroup
	var mu sync.Mutex
	won := 0
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := lock.TryLockOnce(ctx, "racer", clusterID); err == nil {
				mu.Lock()
				won++
				mu.Unlock()
			} else if !errors.Is(err, nodelock.ErrLocked) {
				t.Errorf("TryLockOnce: %v", err)
			}
		}()
	}
	wg.Wait()
	if won != 1 {
		t.Fatalf("%d callers took the lock, want 1", won)
	}
	raw, err := vtpm.NewIssuer(open, zap.NewNop()).Issue(ctx, nil, []byte("n"))
	if err != nil {
		t.Fatal(err)
	}
	var doc vtpm.Document
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(doc.PCRs[vtpm.DefaultLockPCR], vtpm.ExpectedLockValue(clusterID)) {
		t.Fatal("lock PCR does not hold the cluster ID exactly once")
	}
}

// mixed is how attested TLS mixes an activation secret into a nonce; any injective mix serves here.
func mixed(nonce, secret []byte) []byte { return append(append([]byte{}, nonce...), secret...) }

func TestActivation(t *testing.T) {
	ctx := context.Background()
	ca := vtpmtest.NewSwtpmCA(t)
	a, b := vtpmtest.StartSwtpm(t, ca), vtpmtest.StartSwtpm(t, ca)
	issA, issB := vtpm.NewIssuer(a.Open, zap.NewNop()), vtpm.NewIssuer(b.Open, zap.NewNop())
	v, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	nonce := []byte("nonce")

	// Genuine: A's identity, A activates, A quotes.
	idA, err := issA.Identity(ctx)
	if err != nil {
		t.Fatal(err)
	}
	challenge, secret, validate, err := v.Challenge(idA)
	if err != nil {
		t.Fatal(err)
	}
	got, err := issA.Activate(ctx, challenge)
	if err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("Activate: %x, %v; want the secret", got, err)
	}
	doc, err := issA.Issue(ctx, nil, mixed(nonce, got))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validate(ctx, doc, mixed(nonce, secret)); err != nil {
		t.Fatalf("activated document: %v", err)
	}

	// The validator remembers the activated pair: no second activation.
	if c, sec, _, err := v.Challenge(idA); err != nil || c != nil || sec != nil {
		t.Fatalf("second challenge for an activated key: %x, %x, %v; want none", c, sec, err)
	}

	// Forged, on a validator that has not seen A: A's identity (genuine EK certificate) but B's TPM
	// answers; it cannot recover the secret.
	v, err = vtpm.NewValidator(policyFor(t, [][]byte{ca.RootPEM(t), ca.IssuerPEM(t)}, ""), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	challenge, secret, validate, err = v.Challenge(idA)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := issB.Activate(ctx, challenge); err == nil {
		t.Fatal("TPM B activated a credential made for TPM A")
	}
	guess := make([]byte, len(secret))
	docB, err := issB.Issue(ctx, nil, mixed(nonce, guess))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validate(ctx, docB, mixed(nonce, secret)); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("B's document under A's challenge: got %v, want ErrUntrustedRoot", err)
	}
	// A genuine A document without the secret mixed in: activation not proven.
	docA, err := issA.Issue(ctx, nil, mixed(nonce, guess))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := validate(ctx, docA, mixed(nonce, secret)); !errors.Is(err, attestation.ErrUntrustedRoot) {
		t.Fatalf("A's document without the secret: got %v, want ErrUntrustedRoot", err)
	}
}

func FuzzChallenge(f *testing.F) {
	f.Add([]byte{0, 1, 0, 0, 1, 0})
	f.Add([]byte{})
	p, err := policy.Parse([]byte("variant: tpm\ntrustRoots:\n  - pem: |\n"+indentPEM(mustCA(f).PEM())), "fuzz", nil)
	if err != nil {
		f.Fatal(err)
	}
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, identity []byte) {
		_, _, validate, err := v.Challenge(identity)
		if err != nil {
			return
		}
		if _, err := validate(context.Background(), identity, []byte("n")); err == nil {
			t.Fatal("validated a fuzzed document")
		}
	})
}

func TestNewValidatorChecksPolicy(t *testing.T) {
	ca, err := vtpmtest.NewCA("CA")
	if err != nil {
		t.Fatal(err)
	}
	for name, m := range map[string]string{
		"short digest": "  4: {expected: abcd}\n",
		"PCR 24":       "  24: {nonZero: true}\n",
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := vtpm.NewValidator(policyFor(t, [][]byte{ca.PEM()}, m), zap.NewNop()); !errors.Is(err, policy.ErrInvalid) {
				t.Fatalf("got %v, want policy.ErrInvalid", err)
			}
		})
	}
}
