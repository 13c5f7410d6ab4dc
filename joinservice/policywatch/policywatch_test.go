package policywatch

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/joinservice/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

func caPEM(t *testing.T) string {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test EK CA"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

// tpmPolicy is a tpm policy expecting PCR 4 = pcr4 (64 hex digits) with a test EK CA.
func tpmPolicy(t *testing.T, pcr4 string) string {
	var sb strings.Builder
	sb.WriteString("variant: tpm\nmeasurements:\n  4: {expected: " + pcr4 + ", source: the image}\ntrustRoots:\n  - pem: |\n")
	for _, l := range strings.Split(strings.TrimSpace(caPEM(t)), "\n") {
		sb.WriteString("      " + l + "\n")
	}
	return sb.String()
}

func build(p *policy.Policy) (atls.Validator, error) {
	return server.NewHandshakeValidator(p, zap.NewNop())
}

func pcr4(p *policy.Policy) string {
	for _, e := range p.Expectations {
		if e.Index == 4 && len(e.AnyOf) > 0 {
			return strings.ToLower(strings.TrimSpace(string(hexOf(e.AnyOf[0]))))
		}
	}
	return ""
}

func hexOf(b []byte) []byte {
	const digits = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, c := range b {
		out = append(out, digits[c>>4], digits[c&15])
	}
	return out
}

var (
	zeros = strings.Repeat("00", 32)
	ones  = strings.Repeat("11", 32)
)

func TestHolderSwapsAndRefuses(t *testing.T) {
	h, err := NewHolder("tpm", "test", tpmPolicy(t, zeros), build)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := h.Validator().(atls.Challenger); !ok {
		t.Fatal("the tpm handshake validator lost key activation")
	}
	if h.Validator().Variant() != "tpm" {
		t.Fatal("wrong variant")
	}
	for name, doc := range map[string]string{
		"malformed YAML":     "variant: tpm\nmeasurements: [",
		"other variant":      "variant: tdx\n",
		"unknown field":      "variant: tpm\nmeasurments: {}\n",
		"no trust roots":     "variant: tpm\nmeasurements:\n  4: {expected: " + ones + "}\n",
		"PCR beyond the TPM": strings.Replace(tpmPolicy(t, ones), "  4:", "  30:", 1),
	} {
		if _, err := h.Update(doc); !errors.Is(err, ErrRefused) {
			t.Errorf("%s: Update() = %v, want ErrRefused", name, err)
		}
		if pcr4(h.Policy()) != zeros {
			t.Fatalf("%s: the policy in force changed", name)
		}
	}
	changed, err := h.Update(tpmPolicy(t, ones))
	if err != nil || !changed || pcr4(h.Policy()) != ones {
		t.Fatalf("Update() = %v, %v; policy expects %s", changed, err, pcr4(h.Policy()))
	}
}

func TestHolderConcurrentChecksDuringSwaps(t *testing.T) {
	h, err := NewHolder("tpm", "test", tpmPolicy(t, zeros), build)
	if err != nil {
		t.Fatal(err)
	}
	docs := []string{tpmPolicy(t, zeros), tpmPolicy(t, ones)}
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				_, _ = h.Check(context.Background()) // no evidence: ErrNoEvidence, but reads the pointer
				_ = h.Validator().Variant()
				if i == 0 {
					_, _ = h.Update(docs[len(docs)%2])
					docs = append(docs, "")
				}
			}
		}()
	}
	wg.Wait()
}

type reloads struct {
	mu               sync.Mutex
	applied, refused int
}

func (r *reloads) PolicyReload(ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ok {
		r.applied++
	} else {
		r.refused++
	}
}

func (r *reloads) get() (int, int) { r.mu.Lock(); defer r.mu.Unlock(); return r.applied, r.refused }

// TestWatcherOnAPIServer installs Berth's components like berth init, then watches the join
// configuration with the joinservice's own RBAC identity: an update takes effect without a restart, a
// malformed update is refused with an Event and the previous policy stays.
func TestWatcherOnAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, tpmPolicy(t, zeros)); err != nil {
		t.Fatal(err)
	}
	admin := env.Client(t, apiservertest.AdminUser)
	cms := admin.CoreV1().ConfigMaps(joinconfig.Namespace)
	cm, err := cms.Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewHolder("tpm", "ConfigMap", cm.Data[joinconfig.KeyAttestationPolicy], build)
	if err != nil {
		t.Fatal(err)
	}
	obs := &reloads{}
	w := NewWatcher(env.Client(t, apiservertest.JoinServiceUser), joinconfig.Namespace, joinconfig.JoinConfigName, "cp-0", h, obs, zap.NewNop())
	wctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(wctx) }()
	defer func() { cancel(); <-done }()

	update := func(doc string) {
		t.Helper()
		cm, err := cms.Get(ctx, joinconfig.JoinConfigName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		cm.Data[joinconfig.KeyAttestationPolicy] = doc
		if _, err := cms.Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		if err := wait.PollUntilContextTimeout(ctx, 20*time.Millisecond, 20*time.Second, true, func(context.Context) (bool, error) {
			return cond(), nil
		}); err != nil {
			t.Fatalf("waiting for %s: %v", what, err)
		}
	}

	update(tpmPolicy(t, ones))
	waitFor("the new policy", func() bool { return pcr4(h.Policy()) == ones })

	update("variant: tpm\nmeasurements: [")
	waitFor("a refusal", func() bool { _, refused := obs.get(); return refused == 1 })
	if pcr4(h.Policy()) != ones {
		t.Fatal("a malformed update replaced the policy")
	}
	waitFor("the PolicyRejected event", func() bool {
		evs, err := admin.CoreV1().Events(joinconfig.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=PolicyRejected"})
		if err == nil && len(evs.Items) > 0 {
			t.Logf("event: %s", evs.Items[0].Message)
			return true
		}
		return false
	})
	evs, err := admin.CoreV1().Events(joinconfig.Namespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=PolicyApplied"})
	if err != nil || len(evs.Items) == 0 {
		t.Fatalf("no PolicyApplied event: %v", err)
	}
}
