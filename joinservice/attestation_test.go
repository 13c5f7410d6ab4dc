package joinservice

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"

	"go.uber.org/zap"

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

// TestCertifyAKChecksItsOwnIdentity: a replica certifies its AK only when the cluster's policy trusts
// its own EK (its nodes' ValidateCertified then skips the EK chain); with an EK the policy does not
// root, or a policy for another variant, it certifies nothing and nodes activate as before.
func TestCertifyAKChecksItsOwnIdentity(t *testing.T) {
	ctx := context.Background()
	ekCA := vtpmtest.NewSwtpmCA(t)
	tpm := vtpmtest.StartSwtpm(t, ekCA)
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
	for _, tc := range []struct {
		name, policy string
		certified    bool
	}{
		{"an EK the policy roots", "variant: tpm\ntrustRoots:\n" + pem(ekCA.RootPEM(t)) + pem(ekCA.IssuerPEM(t)), true},
		{"an EK the policy does not root", "variant: tpm\ntrustRoots:\n" + pem(other.PEM()), false},
		{"a policy for TDX", "variant: tdx\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			issuer := vtpm.NewIssuer(tpm.Open, zap.NewNop())
			ops := &opCount{}
			p := &policy.Policy{Variant: "tdx"}
			if tc.policy != "variant: tdx\n" {
				if p, err = policy.Parse([]byte(tc.policy), "cluster policy", nil); err != nil {
					t.Fatal(err)
				}
			}
			certifyAK(ctx, issuer, keys, p, ops, zap.NewNop())
			raw, err := issuer.Issue(ctx, nil, []byte("nonce"))
			if err != nil {
				t.Fatal(err)
			}
			doc, err := vtpm.ParseDocument(raw)
			if err != nil {
				t.Fatal(err)
			}
			if got := len(doc.AKCert) > 0; got != tc.certified {
				t.Fatalf("documents carry an AK certificate: %v, want %v", got, tc.certified)
			}
			if tc.policy != "variant: tdx\n" && ops.n[metrics.PurposeSelfCheck+"/"+metrics.OperationQuote] != 1 {
				t.Fatalf("attestation operations %v, want the identity check's quote counted as a self-check", ops.n)
			}
		})
	}
}
