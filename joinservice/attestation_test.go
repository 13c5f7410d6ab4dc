package joinservice

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/joinservice/metrics"
)

// opCount counts attestation operations by purpose and operation.
type opCount struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *opCount) AttestationOperation(purpose, operation string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[purpose+"/"+operation]++
}

// certifyFixture is a replica's swtpm, the cluster's keys, and two cluster policies in YAML: one that
// roots the swtpm's EK and one that roots only another CA.
type certifyFixture struct {
	tpm              *vtpmtest.Swtpm
	keys             *clusterkeys.Keys
	rooting, foreign string
}

func newCertifyFixture(t *testing.T) certifyFixture {
	t.Helper()
	ekCA := vtpmtest.NewSwtpmCA(t)
	other, err := vtpmtest.NewCA("another EK CA")
	if err != nil {
		t.Fatal(err)
	}
	keys, err := clusterkeys.New(bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	pem := func(b []byte) string {
		return "  - pem: |\n      " + strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", "\n      ") + "\n"
	}
	return certifyFixture{
		tpm:     vtpmtest.StartSwtpm(t, ekCA),
		keys:    keys,
		rooting: "variant: tpm\ntrustRoots:\n" + pem(ekCA.RootPEM(t)) + pem(ekCA.IssuerPEM(t)),
		foreign: "variant: tpm\ntrustRoots:\n" + pem(other.PEM()),
	}
}

func parsePolicy(t *testing.T, doc string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(doc), "cluster policy", nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// hasAKCert reports whether issuer's documents carry an AK certificate.
func hasAKCert(t *testing.T, issuer atls.Issuer) bool {
	t.Helper()
	raw, err := issuer.Issue(context.Background(), nil, []byte("nonce"))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := vtpm.ParseDocument(raw)
	if err != nil {
		t.Fatal(err)
	}
	return len(doc.AKCert) > 0
}

// TestCertifyAKChecksItsOwnIdentity: a replica certifies its AK only when the cluster's policy trusts
// its own EK (its nodes' ValidateCertified then skips the EK chain); with an EK the policy does not
// root, or a policy for another variant, it certifies nothing and nodes activate as before.
func TestCertifyAKChecksItsOwnIdentity(t *testing.T) {
	f := newCertifyFixture(t)
	for _, tc := range []struct {
		name, policy string
		certified    bool
	}{
		{"an EK the policy roots", f.rooting, true},
		{"an EK the policy does not root", f.foreign, false},
		{"a policy for TDX", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			issuer := vtpm.NewIssuer(f.tpm.Open, zap.NewNop())
			ops := &opCount{}
			p := &policy.Policy{Variant: "tdx"}
			if tc.policy != "" {
				p = parsePolicy(t, tc.policy)
			}
			failed := certifyAK(context.Background(), issuer, f.keys, p, ops, zap.NewNop())
			if failed == tc.certified {
				t.Errorf("certifyAK reports a failure: %v, want %v", failed, !tc.certified)
			}
			if got := hasAKCert(t, issuer); got != tc.certified {
				t.Fatalf("documents carry an AK certificate: %v, want %v", got, tc.certified)
			}
			if tc.policy != "" && ops.n[metrics.PurposeSelfCheck+"/"+metrics.OperationQuote] != 1 {
				t.Fatalf("attestation operations %v, want the identity check's quote counted as a self-check", ops.n)
			}
		})
	}
}

// flakyIssuer fails its first failures documents, as a TPM that refuses a command does once.
type flakyIssuer struct {
	*vtpm.Issuer
	failures atomic.Int32
}

func (i *flakyIssuer) Issue(ctx context.Context, userData, nonce []byte) ([]byte, error) {
	if i.failures.Add(-1) >= 0 {
		return nil, errors.New("TPM_RC_RETRY (simulated)")
	}
	return i.Issuer.Issue(ctx, userData, nonce)
}

// TestRecertifyAKAfterAFailedStart: a replica whose first certification failed (a TPM command that
// failed once, then a policy that did not root its EK until an update) keeps trying, with the policy
// in force at each attempt, and its documents carry the certificate once an attempt succeeds; it stops
// trying then, or when its context ends.
func TestRecertifyAKAfterAFailedStart(t *testing.T) {
	ctx := context.Background()
	f := newCertifyFixture(t)
	rooting, foreign := parsePolicy(t, f.rooting), parsePolicy(t, f.foreign)
	fast := wait.Backoff{Duration: time.Millisecond, Factor: 2, Steps: 100, Cap: 20 * time.Millisecond}

	issuer := &flakyIssuer{Issuer: vtpm.NewIssuer(f.tpm.Open, zap.NewNop())}
	issuer.failures.Store(2)
	if !certifyAK(ctx, issuer, f.keys, rooting, &opCount{}, zap.NewNop()) {
		t.Fatal("certifyAK with a failing TPM reports no failure")
	}
	if hasAKCert(t, issuer.Issuer) {
		t.Fatal("documents carry an AK certificate after a failed attempt")
	}
	// The first retry fails too (the TPM again), then the policy in force does not root the EK for
	// two attempts; the fourth retry certifies.
	var calls atomic.Int32
	policyInForce := func() *policy.Policy {
		if calls.Add(1) <= 3 {
			return foreign
		}
		return rooting
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		recertifyAK(ctx, fast, issuer, f.keys, policyInForce, &opCount{}, zap.NewNop())
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("recertifyAK did not end after a successful attempt")
	}
	if n := calls.Load(); n != 4 {
		t.Errorf("recertifyAK made %d attempts, want 4 (the fourth certifies)", n)
	}
	if !hasAKCert(t, issuer.Issuer) {
		t.Fatal("documents carry no AK certificate after recertifyAK succeeded")
	}

	// A policy that never roots the EK: it tries until its context ends, then returns.
	never := vtpm.NewIssuer(f.tpm.Open, zap.NewNop())
	cctx, cancel := context.WithCancel(ctx)
	var tries atomic.Int32
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		recertifyAK(cctx, fast, never, f.keys, func() *policy.Policy {
			if tries.Add(1) == 3 {
				cancel()
			}
			return foreign
		}, &opCount{}, zap.NewNop())
	}()
	select {
	case <-ended:
	case <-time.After(time.Minute):
		t.Fatal("recertifyAK did not return when its context ended")
	}
	if hasAKCert(t, never) {
		t.Fatal("an EK the policy never roots got a certificate")
	}
}
