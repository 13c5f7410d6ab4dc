package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
)

// TestBinaryAttestedInit runs init over attested TLS with the node's TPM being a real swtpm whose
// EK certificate comes from a local CA: a node that does not match the policy gets nothing, one that
// matches is initialized and extends its lock PCR, after which it no longer attests as fresh.
func TestBinaryAttestedInit(t *testing.T) {
	ca := vtpmtest.NewSwtpmCA(t) // skips when swtpm's tools are missing
	tpm := vtpmtest.StartSwtpm(t, ca)
	api := newAPIServer(t)
	secret := randomHex(t)
	n := startNode(t, api, secret, false, "--attestation=tpm", "--tpm="+tpm.Spec, "--lock-pcr=15")

	cfgDir := t.TempDir()
	write(t, filepath.Join(cfgDir, "ek-ca.pem"), string(ca.RootPEM(t))+string(ca.IssuerPEM(t)), 0o600)
	zero := strings.Repeat("00", 32)
	write(t, filepath.Join(cfgDir, "fresh.yaml"), "variant: tpm\nmeasurements:\n  15: {expected: "+zero+", source: lock PCR of a fresh node}\ntrustRoots:\n  - file: ek-ca.pem\n", 0o600)
	write(t, filepath.Join(cfgDir, "other-image.yaml"), "variant: tpm\nmeasurements:\n  4: {expected: "+strings.Repeat("ab", 32)+", source: another image}\n  15: {expected: "+zero+"}\ntrustRoots:\n  - file: ek-ca.pem\n", 0o600)
	write(t, filepath.Join(cfgDir, "init-secret"), secret, 0o600)
	for _, name := range []string{"fresh", "other-image"} {
		write(t, filepath.Join(cfgDir, name+"-cluster.yaml"), "initSecretFile: init-secret\nattestationPolicyFile: "+name+".yaml\n", 0o600)
	}

	// A node that does not run what the policy expects is told nothing.
	r := berthInit(t, n.addr, filepath.Join(cfgDir, "other-image-cluster.yaml"), filepath.Join(t.TempDir(), "ws"), "--connect-timeout=20s")
	if r.code != 3 || !strings.Contains(r.output, "failed attestation") || !strings.Contains(r.output, "4") {
		t.Fatalf("berth init against a mismatching node: exit %d\n%s", r.code, r.output)
	}
	if strings.Contains(n.out.String(), "init request accepted") {
		t.Fatal("the init request reached a node that failed attestation")
	}
	if strings.Contains(r.output, "master secret") {
		t.Fatal("a master secret was generated for a node that failed attestation")
	}

	t.Logf("mismatching node:\n%s", r.output)

	// The genuine node is initialized over attested TLS.
	ws := filepath.Join(t.TempDir(), "ws")
	r = berthInit(t, n.addr, filepath.Join(cfgDir, "fresh-cluster.yaml"), ws, "--connect-timeout=20s")
	if r.code != 0 || !strings.Contains(r.output, "Node attested (tpm)") || !strings.Contains(r.output, "Cluster initialized") {
		t.Fatalf("attested berth init: exit %d\n%s", r.code, r.output)
	}
	if _, err := os.Stat(filepath.Join(ws, "admin.conf")); err != nil {
		t.Fatal(err)
	}

	// Its lock PCR now holds the cluster ID: it cannot pass as a fresh node any more.
	r = berthInit(t, n.addr, filepath.Join(cfgDir, "fresh-cluster.yaml"), filepath.Join(t.TempDir(), "ws3"), "--connect-timeout=20s")
	if r.code != 3 || !strings.Contains(r.output, "15") {
		t.Fatalf("berth init against a bootstrapped node: exit %d\n%s", r.code, r.output)
	}
	t.Logf("bootstrapped node:\n%s", r.output)
	n.stop(t)
}
