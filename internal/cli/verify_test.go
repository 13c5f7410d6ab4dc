package cli

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/atls/atlstest"
	"github.com/berth-k8s/berth/internal/atls/evidencefile"
	"github.com/berth-k8s/berth/internal/attestation/tpmsim"
	"github.com/berth-k8s/berth/internal/attestation/vtpm"
	"github.com/berth-k8s/berth/internal/attestation/vtpm/vtpmtest"
	"github.com/berth-k8s/berth/internal/prereq"
)

// attestingNode serves server-attests handshakes from the reference simulator on loopback and
// returns its address and the PEM of its EK CA.
func attestingNode(t *testing.T) (string, []byte) {
	return attestingServer(t, false)
}

// attestingServer is attestingNode; with mutual it also demands client attestation, as the
// joinservice does.
func attestingServer(t *testing.T, mutual bool) (string, []byte) {
	t.Helper()
	sim, err := tpmsim.New()
	if errors.Is(err, tpmsim.ErrUnavailable) {
		prereq.Missing(t, "the TPM simulator needs cgo")
	}
	if err != nil {
		t.Fatal(err)
	}
	ca, err := vtpmtest.NewCA("node EK CA")
	if err != nil {
		t.Fatal(err)
	}
	if err := vtpmtest.ProvisionEKCert(t.Context(), sim.Open, ca); err != nil {
		t.Fatal(err)
	}
	var clientValidator atls.Validator
	if mutual {
		clientValidator = atlstest.Validator{}
	}
	cfg, err := atls.NewServerConfig(vtpm.NewIssuer(sim.Open, zap.NewNop()), clientValidator)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			tc := tls.Server(c, cfg)
			_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
			_ = tc.Handshake()
			tc.Close()
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		wg.Wait()
		_ = sim.Close()
	})
	return lis.Addr().String(), ca.PEM()
}

func writePolicy(t *testing.T, dir, name, measurements string, caPEM []byte) string {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, "ek-ca.pem"), caPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	doc := "variant: tpm\nmeasurements:\n" + measurements + "trustRoots:\n  - file: ek-ca.pem\n"
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func run(args ...string) (int, string) {
	var out bytes.Buffer
	code := Execute(context.Background(), args, &out, &out)
	return code, out.String()
}

func TestVerifyAndPolicyCheck(t *testing.T) {
	addr, caPEM := attestingNode(t)
	dir := t.TempDir()
	zero := strings.Repeat("00", 32)
	good := writePolicy(t, dir, "good.yaml", "  15: {expected: "+zero+", source: lock register of a fresh node}\n", caPEM)
	strict := writePolicy(t, dir, "strict.yaml", "  0: {expected: "+strings.Repeat("ab", 32)+", source: image 9.9}\n  15: {nonZero: true, mode: warn}\n", caPEM)
	evidence := filepath.Join(dir, "node.evidence")

	code, out := run("verify", "--endpoint", addr, "--policy", good, "--save-evidence", evidence)
	if code != 0 || !strings.Contains(out, "verdict: ACCEPTED") || !strings.Contains(out, "15: "+zero+"  [enforce]") {
		t.Fatalf("verify with the good policy: exit %d\n%s", code, out)
	}
	code, out = run("policy", "check", "--policy", good, "--evidence", evidence)
	if code != 0 || !strings.Contains(out, "verdict: ACCEPTED") {
		t.Fatalf("policy check with the good policy: exit %d\n%s", code, out)
	}
	// The stricter policy rejects the recorded evidence offline, naming index, values and source,
	// and reports the warn-only deviation.
	code, out = run("policy", "check", "--policy", strict, "--evidence", evidence)
	for _, want := range []string{"verdict: REJECTED", "index 0", strings.Repeat("ab", 32), "image 9.9", "strict.yaml:4", "warnings:", "index 15"} {
		if !strings.Contains(out, want) {
			t.Errorf("policy check output lacks %q", want)
		}
	}
	if code != exitRejected {
		t.Fatalf("policy check with the strict policy: exit %d, want %d\n%s", code, exitRejected, out)
	}
	code, out = run("verify", "--endpoint", addr, "--policy", strict)
	if code != exitRejected || !strings.Contains(out, "measurements:") {
		t.Fatalf("verify with the strict policy: exit %d\n%s", code, out)
	}
	// Evidence replayed under another nonce is a replay.
	data, err := os.ReadFile(evidence)
	if err != nil {
		t.Fatal(err)
	}
	forged := filepath.Join(dir, "forged.evidence")
	if err := os.WriteFile(forged, bytes.Replace(data, []byte(`"nonce": "`), []byte(`"nonce": "AAAA`), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out = run("policy", "check", "--policy", good, "--evidence", forged)
	if code != exitRejected || !strings.Contains(out, "nonce mismatch") {
		t.Fatalf("policy check of forged evidence: exit %d\n%s", code, out)
	}
}

func TestVerifyUsage(t *testing.T) {
	if code, _ := run("verify", "--endpoint", "127.0.0.1:1"); code != exitUsage {
		t.Fatalf("verify without --policy: exit %d, want %d", code, exitUsage)
	}
	if code, _ := run("policy", "check", "--policy", "nonexistent.yaml", "--evidence", "x"); code != exitUsage {
		t.Fatalf("policy check with a missing policy: exit %d, want %d", code, exitUsage)
	}
}

// TestVerifyMutualServer: a server that demands client attestation (a joinservice) still attests to
// berth verify, which has nothing to attest itself.
func TestVerifyMutualServer(t *testing.T) {
	addr, caPEM := attestingServer(t, true)
	policyPath := writePolicy(t, t.TempDir(), "p.yaml", "  15: {expected: "+strings.Repeat("00", 32)+"}\n", caPEM)
	code, out := run("verify", "--endpoint", addr, "--policy", policyPath)
	if code != 0 || !strings.Contains(out, "verdict: ACCEPTED") || !strings.Contains(out, "attestation key: activated") {
		t.Fatalf("verify against a mutual server: exit %d\n%s", code, out)
	}
}

// decodeVerdict decodes berth verify / policy check -o json|yaml output.
func decodeVerdict(t *testing.T, format, out string) map[string]any {
	t.Helper()
	var m map[string]any
	var err error
	if format == "json" {
		err = json.Unmarshal([]byte(out), &m)
	} else {
		err = yaml.Unmarshal([]byte(out), &m)
	}
	if err != nil {
		t.Fatalf("decoding -o %s: %v\n%s", format, err, out)
	}
	for _, k := range []string{"endpoint", "evidenceFile", "capturedAt", "variant", "attestationKeyActivated", "policy",
		"measurementsVerified", "measurements", "warnings", "verdict", "reason"} {
		if _, ok := m[k]; !ok {
			t.Errorf("-o %s lacks %q:\n%s", format, k, out)
		}
	}
	return m
}

// runSplit runs berth and returns the exit code, stdout and stderr apart.
func runSplit(args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := Execute(context.Background(), args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// TestVerifyStructured: verify and policy check print their report as JSON and YAML with the
// documented fields, on stdout only, accepted (exit 0) and rejected (exit 3).
func TestVerifyStructured(t *testing.T) {
	addr, caPEM := attestingNode(t)
	dir := t.TempDir()
	zero := strings.Repeat("00", 32)
	good := writePolicy(t, dir, "good.yaml", "  15: {expected: "+zero+"}\n", caPEM)
	strict := writePolicy(t, dir, "strict.yaml", "  0: {expected: "+strings.Repeat("ab", 32)+"}\n", caPEM)
	evidence := filepath.Join(dir, "node.evidence")

	code, out, stderr := runSplit("verify", "--endpoint", addr, "--policy", good, "--save-evidence", evidence, "-o", "json")
	m := decodeVerdict(t, "json", out)
	if code != exitOK || m["verdict"] != "ACCEPTED" || m["endpoint"] != addr || m["evidenceFile"] != evidence || m["variant"] != "tpm" ||
		m["attestationKeyActivated"] != true || m["measurementsVerified"] != true || m["reason"] != "" {
		t.Fatalf("verify -o json: exit %d\n%s", code, out)
	}
	if !strings.Contains(stderr, "evidence saved to") || strings.Contains(out, "evidence saved to") {
		t.Errorf("the evidence note belongs on stderr: stdout %q stderr %q", out, stderr)
	}
	var found bool
	for _, e := range m["measurements"].([]any) {
		mr := e.(map[string]any)
		if mr["index"] == float64(15) {
			found = mr["value"] == zero && mr["mode"] == "enforce"
		}
	}
	if !found {
		t.Errorf("verify -o json: no enforced measurement 15 = %s:\n%s", zero, out)
	}

	code, out, _ = runSplit("policy", "check", "--policy", strict, "--evidence", evidence, "-o", "yaml")
	m = decodeVerdict(t, "yaml", out)
	if code != exitRejected || m["verdict"] != "REJECTED" || !strings.Contains(m["reason"].(string), "index 0") || m["evidenceFile"] != evidence || m["endpoint"] != addr {
		t.Fatalf("policy check -o yaml of a rejected node: exit %d\n%s", code, out)
	}
	code, out, _ = runSplit("verify", "--endpoint", addr, "--policy", strict, "-o", "json")
	if m = decodeVerdict(t, "json", out); code != exitRejected || m["verdict"] != "REJECTED" || m["evidenceFile"] != "" {
		t.Fatalf("verify -o json of a rejected node: exit %d\n%s", code, out)
	}
}

// writeUnattestedEvidence writes an evidence file whose certificate carries no attestation and a
// TPM policy that trusts a fresh EK CA; no TPM is needed.
func writeUnattestedEvidence(t *testing.T, dir string) (policyPath, evidencePath string) {
	t.Helper()
	ca, err := vtpmtest.NewCA("node EK CA")
	if err != nil {
		t.Fatal(err)
	}
	policyPath = writePolicy(t, dir, "p.yaml", "  15: {expected: "+strings.Repeat("00", 32)+"}\n", ca.PEM())
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "not attested"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	evidencePath = filepath.Join(dir, "unattested.evidence")
	if err := evidencefile.Write(evidencePath, "198.51.100.10:9000", der, bytes.Repeat([]byte{1}, 32), time.Now().UTC()); err != nil {
		t.Fatal(err)
	}
	return policyPath, evidencePath
}

// TestPolicyCheckUnattested runs without a TPM: evidence without attestation is rejected (exit 3)
// in every format, and the JSON says why.
func TestPolicyCheckUnattested(t *testing.T) {
	p, ev := writeUnattestedEvidence(t, t.TempDir())
	code, out, _ := runSplit("policy", "check", "--policy", p, "--evidence", ev)
	if code != exitRejected || !strings.Contains(out, "verdict: REJECTED") || !strings.Contains(out, "evidence: "+ev+" (from 198.51.100.10:9000") {
		t.Fatalf("policy check (text): exit %d\n%s", code, out)
	}
	code, out, _ = runSplit("policy", "check", "--policy", p, "--evidence", ev, "-o", "json")
	m := decodeVerdict(t, "json", out)
	if code != exitRejected || m["verdict"] != "REJECTED" || m["reason"] == "" || m["variant"] != "" {
		t.Fatalf("policy check -o json: exit %d\n%s", code, out)
	}
	if code, _, stderr := runSplit("policy", "check", "--policy", p, "--evidence", ev, "-o", "xml"); code != exitUsage || !strings.Contains(stderr, "unknown output format") {
		t.Fatalf("-o xml: exit %d, stderr %q", code, stderr)
	}
}

// TestPolicyCheckPinnedEK: berth verify shows the digest of the node's EK public area, and berth
// policy check judges recorded evidence under tpm.ekTrust: pinned: accepted when that EK is
// pinned, rejected when another is (its certificate, though it chains, counts for nothing there).
func TestPolicyCheckPinnedEK(t *testing.T) {
	addr, caPEM := attestingNode(t)
	dir := t.TempDir()
	good := writePolicy(t, dir, "good.yaml", "  15: {expected: "+strings.Repeat("00", 32)+"}\n", caPEM)
	evidence := filepath.Join(dir, "node.evidence")
	code, out, _ := runSplit("verify", "--endpoint", addr, "--policy", good, "--save-evidence", evidence, "-o", "json")
	m := decodeVerdict(t, "json", out)
	ek, _ := m["ekPublicSHA256"].(string)
	if code != exitOK || len(ek) != 64 {
		t.Fatalf("verify -o json: exit %d, ekPublicSHA256 %q\n%s", code, ek, out)
	}
	pinned := func(name, digest string) string {
		path := filepath.Join(dir, name)
		doc := "variant: tpm\nmeasurements:\n  15: {expected: " + strings.Repeat("00", 32) + "}\ntpm:\n  ekTrust: pinned\n  ekPublicSHA256: [" + digest + "]\n"
		if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	code, out = run("policy", "check", "--policy", pinned("pinned.yaml", ek), "--evidence", evidence)
	if code != exitOK || !strings.Contains(out, "verdict: ACCEPTED") || !strings.Contains(out, "endorsement key: public area SHA-256 "+ek) {
		t.Fatalf("policy check with the node's EK pinned: exit %d\n%s", code, out)
	}
	code, out = run("policy", "check", "--policy", pinned("other.yaml", strings.Repeat("ab", 32)), "--evidence", evidence)
	if code != exitRejected || !strings.Contains(out, "EK "+ek+" is not among the policy's pinned EKs") {
		t.Fatalf("policy check with another EK pinned: exit %d\n%s", code, out)
	}
}
