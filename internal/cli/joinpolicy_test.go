package cli

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/attestation/policy"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

func testKeys(t *testing.T) *clusterkeys.Keys {
	t.Helper()
	master, salt := make([]byte, 32), make([]byte, 32)
	_, _ = rand.Read(master)
	_, _ = rand.Read(salt)
	k, err := clusterkeys.New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// The join policy berth init writes is the operator's file, read and inlined, with this cluster's
// attestation-key CA added (policyedit's tests cover the edit itself): self-contained, certifying
// keys, different per cluster, and a TDX policy is left alone.
func TestClusterJoinPolicy(t *testing.T) {
	ekCA, err := vtpmtest.NewCA("join policy test EK CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ek-ca.pem"), ekCA.PEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	const base = "# the image's join policy\nvariant: tpm\nmeasurements:\n  15: {nonZero: true, source: bootstrapped}\ntrustRoots:\n  - file: ek-ca.pem\n"
	path := filepath.Join(dir, "join.yaml")
	if err := os.WriteFile(path, []byte(base), 0o600); err != nil {
		t.Fatal(err)
	}
	tmpl, err := loadJoinPolicy(path)
	if err != nil {
		t.Fatal(err)
	}
	keys := testKeys(t)
	ca, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		t.Fatal(err)
	}
	out, err := clusterJoinPolicy(tmpl, keys)
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.Parse(out, "out", nil) // no file access: self-contained
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if len(p.AKRoots) != 1 || !p.AKRoots[0].Equal(ca.Cert) {
		t.Fatalf("akRoots = %d certificates, want this cluster's CA alone\n%s", len(p.AKRoots), out)
	}
	if v, err := vtpm.NewValidator(p, zap.NewNop()); err != nil || !v.CertifiesKeys() {
		t.Fatalf("validator = %v, certifies keys: %v", err, v != nil && v.CertifiesKeys())
	}

	// Another cluster's policy names another CA.
	if other, _ := clusterJoinPolicy(tmpl, testKeys(t)); bytes.Equal(out, other) {
		t.Error("two clusters got the same join policy")
	}
	// A TDX join policy has no attestation keys: unchanged.
	tdxPolicy := []byte("variant: tdx\ntdx: {collateralDir: c}\n")
	if out, err := clusterJoinPolicy(tdxPolicy, keys); err != nil || !bytes.Equal(out, tdxPolicy) {
		t.Errorf("TDX join policy = %q, %v", out, err)
	}
}

// A join policy a node could not use stops berth init before it connects to anything.
func TestLoadJoinPolicyRefusesBadPolicies(t *testing.T) {
	dir := t.TempDir()
	for name, src := range map[string]string{
		"not a policy":    "variant: tpm\nmeasurements: [1, 2]\n",
		"no EK CA":        "variant: tpm\nmeasurements:\n  15: {nonZero: true}\n",
		"missing CA file": "variant: tpm\ntrustRoots:\n  - file: missing.pem\n",
		"unknown field":   "variant: tpm\nakRoot: []\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, "join.yaml"), []byte(src), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := loadJoinPolicy(filepath.Join(dir, "join.yaml"))
		var ee *exitError
		if !errors.As(err, &ee) || ee.code != exitUsage {
			t.Errorf("%s: loadJoinPolicy = %v, want a usage error", name, err)
		}
	}
	if data, err := loadJoinPolicy(""); data != nil || err != nil {
		t.Errorf("no joinPolicyFile: %q, %v", data, err)
	}
}

// berth policy join prints a workspace's cluster join policy, the same berth init writes.
func TestPolicyJoinCommand(t *testing.T) {
	ekCA, err := vtpmtest.NewCA("EK CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "ek-ca.pem"), ekCA.PEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(dir, "image-join.yaml")
	if err := os.WriteFile(src, []byte("variant: tpm\nmeasurements:\n  15: {nonZero: true}\ntrustRoots:\n  - file: ek-ca.pem\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ws := filepath.Join(dir, "ws")
	if code, out := run("policy", "join", "--policy", src, "--workspace", ws); code != exitUsage {
		t.Fatalf("a workspace without a master secret: exit %d\n%s", code, out)
	}
	master, salt, err := prepareWorkspace(ws, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	code, out, stderr := runSplit("policy", "join", "--policy", src, "--workspace", ws)
	if code != exitOK {
		t.Fatalf("policy join: exit %d\n%s", code, stderr)
	}
	keys, err := clusterkeys.New(master, salt)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := vtpm.ClusterAKCA(keys.AKCASeed(), keys.ClusterID())
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.Parse([]byte(out), "out", nil)
	if err != nil || len(p.AKRoots) != 1 || !p.AKRoots[0].Equal(ca.Cert) || len(p.TrustRoots) != 1 {
		t.Fatalf("policy join printed (%v):\n%s", err, out)
	}
}
