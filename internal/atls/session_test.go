package atls_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/attestation"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// countingTPM counts the TPM work an attesting server does: quotes and activations.
type countingTPM struct {
	*vtpm.Issuer
	quotes, activations, identities atomic.Int32
}

func (c *countingTPM) Identity(ctx context.Context) ([]byte, error) {
	c.identities.Add(1)
	return c.Issuer.Identity(ctx)
}

func (c *countingTPM) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	c.quotes.Add(1)
	return c.Issuer.Issue(ctx, userData, nonce)
}

func (c *countingTPM) Activate(ctx context.Context, challenge []byte) ([]byte, error) {
	c.activations.Add(1)
	return c.Issuer.Activate(ctx, challenge)
}

// sessionSetup is a server TPM on swtpm whose AK the cluster's AK CA certified, and the policies a
// client may judge it by.
type sessionSetup struct {
	tpm     *countingTPM
	ekRoots []byte
	akCA    *vtpm.AKCA
}

func newSessionSetup(t *testing.T) sessionSetup {
	t.Helper()
	ca := vtpmtest.NewSwtpmCA(t) // skips without swtpm
	sw := vtpmtest.StartSwtpm(t, ca)
	akCA, err := vtpm.NewAKCA(bytes.Repeat([]byte{3}, 32), "test cluster AK CA")
	if err != nil {
		t.Fatal(err)
	}
	issuer := vtpm.NewIssuer(sw.Open, zap.NewNop())
	if err := issuer.CertifyAK(t.Context(), akCA.Certify); err != nil {
		t.Fatal(err)
	}
	return sessionSetup{tpm: &countingTPM{Issuer: issuer}, ekRoots: append(ca.RootPEM(t), ca.IssuerPEM(t)...), akCA: akCA}
}

// validator judges the server by the EK roots, the AK CA when certified, and measurements.
func (s sessionSetup) validator(t *testing.T, certified bool, measurements string) *vtpm.Validator {
	t.Helper()
	doc := "variant: tpm\n"
	if measurements != "" {
		doc += "measurements:\n" + measurements
	}
	doc += "trustRoots:\n  - pem: |\n" + indentLines(string(s.ekRoots))
	if certified {
		doc += "akRoots:\n  - pem: |\n" + indentLines(string(s.akCA.PEM()))
	}
	p, err := policy.Parse([]byte(doc), "test-policy.yaml", nil)
	if err != nil {
		t.Fatal(err)
	}
	v, err := vtpm.NewValidator(p, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func indentLines(s string) string {
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
		b.WriteString("      " + line + "\n")
	}
	return b.String()
}

// verdictOf dials addr with creds and returns the client's verdict on the server and the evidence.
func verdictOf(ctx context.Context, t *testing.T, addr string, validator atls.Validator, opts ...atls.Option) (atls.Evidence, error) {
	t.Helper()
	var mu sync.Mutex
	var ev atls.Evidence
	var verdict error
	seen := false
	creds := mustCreds(t, nil, validator, append(opts, atls.WithObserver(func(e atls.Evidence, err error) {
		mu.Lock()
		defer mu.Unlock()
		ev, verdict, seen = e, err, true
	}))...)
	rpcErr := check(ctx, addr, creds)
	mu.Lock()
	defer mu.Unlock()
	if !seen {
		return ev, rpcErr
	}
	if verdict == nil && rpcErr != nil {
		t.Fatalf("server accepted, RPC failed: %v", rpcErr)
	}
	return ev, verdict
}

// TestSessionProof: a client whose policy trusts the cluster's AK CA takes the server's session proof
// (no probe, no quote, no activation per connection) and refuses it once stale; a client without the
// AK CA still activates and gets a quote for its own nonce.
func TestSessionProof(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := newSessionSetup(t)
	sp := atls.NewSessionProof(s.tpm, zap.NewNop())
	if err := sp.Renew(ctx); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	addr, _ := serveGRPC(t, mustCreds(t, s.tpm, nil, atls.WithSessionProof(sp), atls.WithLimiter(unlimited())))
	s.tpm.quotes.Store(0)

	certified := s.validator(t, true, "")
	for range 3 {
		ev, err := verdictOf(ctx, t, addr, certified)
		if err != nil {
			t.Fatalf("session proof: %v", err)
		}
		if ev.IssuedAt.IsZero() || !ev.Activated || len(ev.Result.Measurements) != 24 {
			t.Fatalf("evidence %+v: want a session proof of a certified key with 24 PCRs", ev)
		}
	}
	if q, a := s.tpm.quotes.Load(), s.tpm.activations.Load(); q != 0 || a != 0 {
		t.Fatalf("the server's TPM quoted %d and activated %d times for 3 session handshakes, want 0", q, a)
	}

	t.Run("stale proof refused", func(t *testing.T) {
		later := func() time.Time { return time.Now().Add(atls.DefaultSessionMaxAge + 5*time.Second) }
		if _, err := verdictOf(ctx, t, addr, certified, atls.WithClock(later)); !errors.Is(err, atls.ErrStale) {
			t.Fatalf("got %v, want ErrStale", err)
		}
		short := atls.WithSessionMaxAge(time.Nanosecond)
		if _, err := verdictOf(ctx, t, addr, certified, short, atls.WithClock(func() time.Time { return time.Now().Add(2 * time.Second) })); !errors.Is(err, atls.ErrStale) {
			t.Fatalf("max age 1ns: got %v, want ErrStale", err)
		}
	})
	t.Run("proof from the future refused", func(t *testing.T) {
		earlier := func() time.Time { return time.Now().Add(-time.Minute) }
		if _, err := verdictOf(ctx, t, addr, certified, atls.WithClock(earlier)); !errors.Is(err, atls.ErrStale) {
			t.Fatalf("got %v, want ErrStale", err)
		}
	})
	t.Run("wrong measurements refused", func(t *testing.T) {
		v := s.validator(t, true, "  0: {expected: "+strings.Repeat("ab", 32)+"}\n")
		if _, err := verdictOf(ctx, t, addr, v); !errors.Is(err, attestation.ErrMeasurementMismatch) {
			t.Fatalf("got %v, want ErrMeasurementMismatch", err)
		}
	})
	t.Run("client without the AK CA activates and gets its own quote", func(t *testing.T) {
		q0, a0 := s.tpm.quotes.Load(), s.tpm.activations.Load()
		ev, err := verdictOf(ctx, t, addr, s.validator(t, false, ""))
		if err != nil {
			t.Fatalf("activated handshake: %v", err)
		}
		if !ev.IssuedAt.IsZero() || s.tpm.quotes.Load() != q0+1 || s.tpm.activations.Load() != a0+1 {
			t.Fatalf("want a quote and an activation for this connection (evidence issued at %v)", ev.IssuedAt)
		}
	})
	t.Run("client that accepts no session proof gets its own quote", func(t *testing.T) {
		q0 := s.tpm.quotes.Load()
		ev, err := verdictOf(ctx, t, addr, certified, atls.WithSessionMaxAge(0))
		if err != nil || !ev.IssuedAt.IsZero() || s.tpm.quotes.Load() != q0+1 {
			t.Fatalf("got %v (issued at %v, %d quotes), want a quote for this connection", err, ev.IssuedAt, s.tpm.quotes.Load()-q0)
		}
	})
	t.Run("uncertified server refused by a client that expects a certified key", func(t *testing.T) {
		ca := vtpmtest.NewSwtpmCA(t)
		plain := vtpm.NewIssuer(vtpmtest.StartSwtpm(t, ca).Open, zap.NewNop())
		psp := atls.NewSessionProof(plain, zap.NewNop())
		if err := psp.Renew(ctx); err != nil {
			t.Fatal(err)
		}
		paddr, _ := serveGRPC(t, mustCreds(t, plain, nil, atls.WithSessionProof(psp), atls.WithLimiter(unlimited())))
		v := sessionSetup{ekRoots: append(ca.RootPEM(t), ca.IssuerPEM(t)...), akCA: s.akCA}.validator(t, true, "")
		if _, err := verdictOf(ctx, t, paddr, v); !errors.Is(err, attestation.ErrUntrustedRoot) {
			t.Fatalf("got %v, want ErrUntrustedRoot", err)
		}
	})
	t.Run("session document under another key refused", func(t *testing.T) {
		ev, err := verdictOf(ctx, t, addr, certified)
		if err != nil {
			t.Fatal(err)
		}
		// Whoever copies the genuine proof into a certificate of its own key: the document binds
		// another key.
		genuine, err := x509.ParseCertificate(ev.Certificate)
		if err != nil {
			t.Fatal(err)
		}
		var ext pkix.Extension
		for _, e := range genuine.Extensions {
			if e.Id.Equal(atls.OIDSessionAttestation) {
				ext = e
			}
		}
		forged := atlstest.ServeTLS(t, &tls.Config{MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{certWith(t, ext)}})
		var verdict error
		cfg, err := atls.NewClientConfig(ctx, nil, certified, atls.WithObserver(func(_ atls.Evidence, err error) { verdict = err }))
		if err != nil {
			t.Fatal(err)
		}
		if err := handshake(t, forged, cfg); err == nil || !errors.Is(verdict, attestation.ErrKeyBinding) {
			t.Fatalf("handshake %v, verdict %v; want ErrKeyBinding", err, verdict)
		}
		// And a client that did not ask for a session proof refuses it.
		cfg, err = atls.NewClientConfig(ctx, nil, certified, atls.WithSessionMaxAge(0), atls.WithObserver(func(_ atls.Evidence, err error) { verdict = err }))
		if err != nil {
			t.Fatal(err)
		}
		if err := handshake(t, forged, cfg); err == nil || !errors.Is(verdict, atls.ErrNoAttestation) {
			t.Fatalf("handshake %v, verdict %v; want ErrNoAttestation", err, verdict)
		}
	})
}

// certWith is a self-signed certificate of a fresh key carrying ext.
func certWith(t *testing.T, ext pkix.Extension) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		ExtraExtensions: []pkix.Extension{ext}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestSessionProofRun: Run renews until its context ends and then returns nil.
func TestSessionProofRun(t *testing.T) {
	s := newSessionSetup(t)
	ctx, cancel := context.WithCancel(context.Background())
	sp := atls.NewSessionProof(s.tpm, zap.NewNop())
	done := make(chan error, 1)
	go func() { done <- sp.Run(ctx) }()
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		return s.tpm.quotes.Load() > 0, nil
	}); err != nil {
		t.Fatalf("Run made no session proof: %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// TestProbeRemembered: a client's credentials probe a server's identity once and reuse it for later
// connections to the same authority; a failed handshake forgets it.
func TestProbeRemembered(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s := newSessionSetup(t)
	addr, _ := serveGRPC(t, mustCreds(t, s.tpm, nil, atls.WithLimiter(unlimited())))
	creds := mustCreds(t, nil, s.validator(t, false, ""))
	for i := range 3 {
		if err := check(ctx, addr, creds); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	if n := s.tpm.identities.Load(); n != 1 {
		t.Fatalf("%d identity probes for 3 connections with the same credentials, want 1", n)
	}
	rejecting := mustCreds(t, nil, s.validator(t, false, "  0: {expected: "+strings.Repeat("ab", 32)+"}\n"))
	for range 2 {
		if err := check(ctx, addr, rejecting); err == nil {
			t.Fatal("a client whose policy rejects the server connected")
		}
	}
	if n := s.tpm.identities.Load(); n != 3 {
		t.Fatalf("%d identity probes in all, want 3: a failed handshake forgets the probed identity", n)
	}
}
