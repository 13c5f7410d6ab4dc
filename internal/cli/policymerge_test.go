package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// berth policy merge prints the merged policy; what it cannot merge is a usage error.
func TestPolicyMergeCommand(t *testing.T) {
	const oldPCR4, newPCR4 = "1111111111111111111111111111111111111111111111111111111111111111", "4444444444444444444444444444444444444444444444444444444444444444"
	dir := t.TempDir()
	for name, body := range map[string]string{
		"cluster.yaml": "variant: tpm\nmeasurements:\n  4: {expected: " + oldPCR4 + ", source: image 1}\n",
		"image.yaml":   "variant: tpm\nmeasurements:\n  4: {expected: " + newPCR4 + ", source: image 2}\n",
		"tdx.yaml":     "variant: tdx\nmeasurements:\n  1: {expected: " + newPCR4 + "}\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cluster, image := filepath.Join(dir, "cluster.yaml"), filepath.Join(dir, "image.yaml")
	code, out, stderr := runSplit("policy", "merge", "--policy", cluster, "--measurements", image, "--keep")
	if code != exitOK || !strings.Contains(out, oldPCR4) || !strings.Contains(out, newPCR4) {
		t.Fatalf("policy merge --keep: exit %d\n%s\n%s", code, out, stderr)
	}
	for name, args := range map[string][]string{
		"no measurements": {"--policy", cluster},
		"another variant": {"--policy", cluster, "--measurements", filepath.Join(dir, "tdx.yaml")},
		"a missing file":  {"--policy", cluster, "--measurements", filepath.Join(dir, "missing.yaml")},
	} {
		if code, out := run(append([]string{"policy", "merge"}, args...)...); code != exitUsage {
			t.Errorf("%s: exit %d, want %d\n%s", name, code, exitUsage, out)
		}
	}
}
