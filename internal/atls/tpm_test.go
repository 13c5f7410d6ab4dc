package atls_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/tpmsim"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/prereq"
)

// tpmPair returns an issuer on the reference simulator and validators accepting and rejecting it.
func tpmPair(tb testing.TB) (atls.Issuer, atls.Validator, atls.Validator) {
	tb.Helper()
	sim, err := tpmsim.New()
	if errors.Is(err, tpmsim.ErrUnavailable) {
		prereq.Missing(tb, "the TPM simulator needs cgo")
	}
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = sim.Close() })
	ca, err := vtpmtest.NewCA("EK CA")
	if err != nil {
		tb.Fatal(err)
	}
	if err := vtpmtest.ProvisionEKCert(tb.Context(), sim.Open, ca); err != nil {
		tb.Fatal(err)
	}
	return vtpm.NewIssuer(sim.Open, zap.NewNop()), tpmValidator(tb, ca.PEM(), ""), tpmValidator(tb, ca.PEM(), "  0: {expected: "+strings.Repeat("ab", 32)+"}\n")
}

// swtpmPair is tpmPair on a swtpm process.
func swtpmPair(tb testing.TB) (atls.Issuer, atls.Validator, atls.Validator) {
	tb.Helper()
	ca := vtpmtest.NewSwtpmCA(tb)
	sw := vtpmtest.StartSwtpm(tb, ca)
	roots := append(ca.RootPEM(tb), ca.IssuerPEM(tb)...)
	return vtpm.NewIssuer(sw.Open, zap.NewNop()), tpmValidator(tb, roots, ""), tpmValidator(tb, roots, "  0: {expected: "+strings.Repeat("ab", 32)+"}\n")
}

func tpmValidator(tb testing.TB, rootsPEM []byte, measurements string) atls.Validator {
	tb.Helper()
	doc := "variant: tpm\n"
	if measurements != "" {
		doc += "measurements:\n" + measurements
	}
	doc += "trustRoots:\n  - pem: |\n"
	for _, line := range strings.Split(strings.TrimSpace(string(rootsPEM)), "\n") {
		doc += "      " + line + "\n"
	}
	p, err := policy.Parse([]byte(doc), "test-policy.yaml", nil)
	if err != nil {
		tb.Fatal(err)
	}
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		tb.Fatal(err)
	}
	return v
}

func TestGRPCMutualTPM(t *testing.T) {
	issuer, accept, reject := tpmPair(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	addr, seen := serveGRPC(t, mustCreds(t, issuer, accept))
	if err := check(ctx, addr, mustCreds(t, issuer, accept)); err != nil {
		t.Fatalf("mutual TPM-attested gRPC: %v", err)
	}
	if ev := seen(); ev == nil || ev.Variant != vtpm.Variant || len(ev.Result.Measurements) != 24 || !ev.Activated {
		t.Fatalf("server handler saw evidence %+v", ev)
	}
	// The client rejects the server's measurements: the RPC never runs.
	var verdict error
	creds := mustCreds(t, issuer, reject, atls.WithObserver(func(_ atls.Evidence, err error) { verdict = err }))
	if err := check(ctx, addr, creds); err == nil {
		t.Fatal("RPC succeeded although the client's policy rejects the server")
	}
	if !errors.Is(verdict, attestation.ErrMeasurementMismatch) {
		t.Fatalf("client verdict %v, want ErrMeasurementMismatch", verdict)
	}
}

// benchHandshake measures atls.Dial: for TPM validators that is an identity probe plus the attested
// handshake with key activation.
func benchHandshake(b *testing.B, issuer atls.Issuer, validator atls.Validator, limiter *atls.Limiter, wantErr error) {
	srv, err := atls.NewServerConfig(issuer, nil, atls.WithLimiter(limiter))
	if err != nil {
		b.Fatal(err)
	}
	addr := atlstest.ServeTLS(b, srv)
	ctx := context.Background()
	var d net.Dialer
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tc, err := atls.Dial(ctx, &d, addr, nil, validator)
		if err == nil {
			tc.Close()
		}
		if wantErr == nil && err != nil || wantErr != nil && !errors.Is(err, wantErr) {
			b.Fatalf("handshake: %v, want %v", err, wantErr)
		}
	}
}

func unlimited() *atls.Limiter {
	return atls.NewLimiter(atls.Limits{PerPeer: 1e9, PerPeerBurst: 1 << 30, Global: 1e9, GlobalBurst: 1 << 30})
}

// BenchmarkHandshake measures full server-attests handshakes over loopback: accepted, rejected by the
// client's policy (full cost: quote and validation), and refused by the server's rate limit.
func BenchmarkHandshake(b *testing.B) {
	variants := map[string]func(testing.TB) (atls.Issuer, atls.Validator, atls.Validator){
		"fake": func(testing.TB) (atls.Issuer, atls.Validator, atls.Validator) {
			return atlstest.Issuer{}, atlstest.Validator{}, rejectingValidator{}
		},
		"tpm-simulator": tpmPair,
		"tpm-swtpm":     swtpmPair,
	}
	for _, name := range []string{"fake", "tpm-simulator", "tpm-swtpm"} {
		b.Run(fmt.Sprintf("%s/accepted", name), func(b *testing.B) {
			issuer, accept, _ := variants[name](b)
			benchHandshake(b, issuer, accept, unlimited(), nil)
		})
		if name != "fake" {
			// A validator that never saw the node: every handshake activates the AK.
			b.Run(fmt.Sprintf("%s/accepted-first-contact", name), func(b *testing.B) {
				issuer, accept, _ := variants[name](b)
				benchHandshake(b, issuer, firstContact{accept.(*vtpm.Validator)}, unlimited(), nil)
			})
		}
		b.Run(fmt.Sprintf("%s/rejected-by-policy", name), func(b *testing.B) {
			issuer, _, reject := variants[name](b)
			benchHandshake(b, issuer, reject, unlimited(), attestation.ErrMeasurementMismatch)
		})
		b.Run(fmt.Sprintf("%s/refused-rate-limit", name), func(b *testing.B) {
			issuer, accept, _ := variants[name](b)
			none := atls.NewLimiter(atls.Limits{PerPeer: 0, PerPeerBurst: 0, Global: 0, GlobalBurst: 0})
			benchHandshake(b, issuer, accept, none, atls.ErrRateLimited)
		})
	}
}

// fakeActivation keeps the TPM issuer but answers challenges with a made-up secret, as an attester
// whose AK does not live with the certified EK would have to.
type fakeActivation struct{ *vtpm.Issuer }

func (fakeActivation) Activate(context.Context, []byte) ([]byte, error) {
	return make([]byte, 32), nil
}

// noActivation hides the issuer's Identity and Activate.
type noActivation struct{ inner atls.Issuer }

func (n noActivation) Variant() string { return n.inner.Variant() }
func (n noActivation) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	return n.inner.Issue(ctx, userData, nonce)
}

func TestActivationRequired(t *testing.T) {
	issuer, accept, _ := tpmPair(t)
	vi := issuer.(*vtpm.Issuer)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	testCases := map[string]struct {
		attester atls.Issuer
		wantErr  error
	}{
		"activated":                {attester: vi},
		"secret not recovered":     {attester: fakeActivation{vi}, wantErr: attestation.ErrUntrustedRoot},
		"attester cannot activate": {attester: noActivation{vi}, wantErr: atls.ErrNotActivated},
	}
	fresh := func(t *testing.T) atls.Validator {
		v, err := vtpm.NewValidator(accept.(*vtpm.Validator).Policy(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for name, tc := range testCases {
		t.Run("server attests/"+name, func(t *testing.T) {
			accept := fresh(t)
			srv, err := atls.NewServerConfig(tc.attester, nil, atls.WithLimiter(unlimited()))
			if err != nil {
				t.Fatal(err)
			}
			addr := atlstest.ServeTLS(t, srv)
			var d net.Dialer
			conn, err := atls.Dial(ctx, &d, addr, nil, accept)
			if err == nil {
				conn.Close()
			}
			if tc.wantErr == nil && err != nil || tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("got %v, want %v", err, tc.wantErr)
			}
		})
		t.Run("client attests/"+name, func(t *testing.T) {
			accept := fresh(t)
			var mu sync.Mutex
			var verdict error
			srv, err := atls.NewServerConfig(nil, accept, atls.WithObserver(func(_ atls.Evidence, err error) {
				mu.Lock()
				verdict = err
				mu.Unlock()
			}))
			if err != nil {
				t.Fatal(err)
			}
			addr := atlstest.ServeTLS(t, srv)
			cfg, err := atls.NewClientConfig(ctx, tc.attester, nil)
			if err != nil {
				t.Fatal(err)
			}
			clientErr := handshake(t, addr, cfg)
			mu.Lock()
			defer mu.Unlock()
			if tc.wantErr == nil {
				if clientErr != nil || verdict != nil {
					t.Fatalf("client %v, server %v", clientErr, verdict)
				}
				return
			}
			if clientErr == nil || !errors.Is(verdict, tc.wantErr) {
				t.Fatalf("client %v, server verdict %v; want %v", clientErr, verdict, tc.wantErr)
			}
		})
	}
}

// firstContact is a TPM validator that never saw the node: each Challenge comes from a fresh
// validator with the same policy, so every handshake activates.
type firstContact struct{ *vtpm.Validator }

func (f firstContact) Challenge(id []byte) ([]byte, []byte, func(context.Context, []byte, []byte) (attestation.Result, error), error) {
	fresh, err := vtpm.NewValidator(f.Policy(), zap.NewNop())
	if err != nil {
		return nil, nil, nil, err
	}
	return fresh.Challenge(id)
}

// countingActivator counts activations.
type countingActivator struct {
	*vtpm.Issuer
	mu sync.Mutex
	n  int
}

func (c *countingActivator) Activate(ctx context.Context, challenge []byte) ([]byte, error) {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
	return c.Issuer.Activate(ctx, challenge)
}

// TestActivationRemembered: a validator activates a node's key once; later handshakes skip it.
func TestActivationRemembered(t *testing.T) {
	issuer, accept, _ := tpmPair(t)
	counting := &countingActivator{Issuer: issuer.(*vtpm.Issuer)}
	srv, err := atls.NewServerConfig(counting, nil, atls.WithLimiter(unlimited()))
	if err != nil {
		t.Fatal(err)
	}
	addr := atlstest.ServeTLS(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var d net.Dialer
	for i := 0; i < 3; i++ {
		var ev atls.Evidence
		conn, err := atls.Dial(ctx, &d, addr, nil, accept, atls.WithObserver(func(e atls.Evidence, _ error) { ev = e }))
		if err != nil {
			t.Fatalf("handshake %d: %v", i, err)
		}
		conn.Close()
		if !ev.Activated {
			t.Fatalf("handshake %d: evidence not marked activated", i)
		}
	}
	counting.mu.Lock()
	defer counting.mu.Unlock()
	if counting.n != 1 {
		t.Fatalf("%d activations in 3 handshakes, want 1", counting.n)
	}
}

// wrapIssuer changes what a real issuer binds or returns, for the rejection cases below.
type wrapIssuer struct {
	inner    *vtpm.Issuer
	variant  string
	userData []byte // bind this instead of the TLS key hash
	raw      []byte // return this instead of a document
	mu       sync.Mutex
	replay   bool   // return the first document every time
	first    []byte // the first document
}

func (w *wrapIssuer) Variant() string {
	if w.variant != "" {
		return w.variant
	}
	return w.inner.Variant()
}

func (w *wrapIssuer) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	if w.raw != nil {
		return w.raw, nil
	}
	if w.userData != nil {
		userData = w.userData
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.replay && w.first != nil {
		return w.first, nil
	}
	doc, err := w.inner.Issue(ctx, userData, nonce)
	w.first = doc
	return doc, err
}

func (w *wrapIssuer) Identity(ctx context.Context) ([]byte, error) { return w.inner.Identity(ctx) }
func (w *wrapIssuer) Activate(ctx context.Context, c []byte) ([]byte, error) {
	return w.inner.Activate(ctx, c)
}

// TestTPMRoundTrip runs attested TLS handshakes on the reference simulator and on swtpm: the
// accepted case and each named rejection.
func TestTPMRoundTrip(t *testing.T) {
	backends := map[string]func(testing.TB) (atls.Issuer, atls.Validator, atls.Validator){
		"simulator": tpmPair,
		"swtpm":     swtpmPair,
	}
	for backend, pair := range backends {
		t.Run(backend, func(t *testing.T) {
			issuer, accept, reject := pair(t)
			vi := issuer.(*vtpm.Issuer)
			otherCA, err := vtpmtest.NewCA("someone else's EK CA")
			if err != nil {
				t.Fatal(err)
			}
			untrusting := tpmValidator(t, otherCA.PEM(), "")
			testCases := map[string]struct {
				issuer    atls.Issuer
				validator atls.Validator
				rounds    int
				wantErr   error
			}{
				"accepted":                      {issuer: vi, validator: accept},
				"PCR mismatch":                  {issuer: vi, validator: reject, wantErr: attestation.ErrMeasurementMismatch},
				"replayed document":             {issuer: &wrapIssuer{inner: vi, replay: true}, validator: accept, rounds: 2, wantErr: attestation.ErrNonceMismatch},
				"document bound to another key": {issuer: &wrapIssuer{inner: vi, userData: make([]byte, 32)}, validator: accept, wantErr: attestation.ErrKeyBinding},
				"EK CA not trusted":             {issuer: vi, validator: untrusting, wantErr: attestation.ErrUntrustedRoot},
				"garbage document":              {issuer: &wrapIssuer{inner: vi, raw: []byte("{\"variant\":\"tpm\",")}, validator: accept, wantErr: attestation.ErrMalformed},
				"unknown variant":               {issuer: &wrapIssuer{inner: vi, variant: "sev-snp"}, validator: accept, wantErr: attestation.ErrUnknownVariant},
			}
			for name, tc := range testCases {
				t.Run(name, func(t *testing.T) {
					srv, err := atls.NewServerConfig(tc.issuer, nil, atls.WithLimiter(unlimited()))
					if err != nil {
						t.Fatal(err)
					}
					addr := atlstest.ServeTLS(t, srv)
					ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
					defer cancel()
					var d net.Dialer
					var lastErr error
					for i := 0; i < max(tc.rounds, 1); i++ {
						conn, err := atls.Dial(ctx, &d, addr, nil, tc.validator)
						if err == nil {
							conn.Close()
						}
						lastErr = err
					}
					if tc.wantErr == nil && lastErr != nil || tc.wantErr != nil && !errors.Is(lastErr, tc.wantErr) {
						t.Fatalf("got %v, want %v", lastErr, tc.wantErr)
					}
				})
			}
		})
	}
}
