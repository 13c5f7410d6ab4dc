//go:build e2e

package e2e

import (
	"archive/tar"
	"compress/gzip"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/workspace"
)

// checkSupportBundle: berth support on the running cluster writes an archive with the Machines, the
// joinservice's log, every node's bootstrapper log (--mini-dir) and berth status's report, and a
// manifest; no file in it holds the cluster's master secret.
func checkSupportBundle(t testing.TB, c *cluster) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "support.tar.gz")
	start := time.Now()
	got, err := c.run(3*time.Minute, c.berth, "support", "--kubeconfig", filepath.Join(c.dir, "admin.conf"), "--mini-dir", c.dir, "--out", out)
	if err != nil {
		t.Errorf("berth support: %v\n%s", err, got)
		return
	}
	st, err := os.Stat(out)
	if err != nil {
		t.Errorf("berth support wrote no archive: %v", err)
		return
	}
	t.Logf("berth support took %.1fs, %d bytes:\n%s", time.Since(start).Seconds(), st.Size(), got)
	raw, err := os.ReadFile(filepath.Join(c.dir, workspace.MasterSecret))
	if err != nil {
		t.Fatal(err)
	}
	var secret struct {
		MasterSecret string `json:"masterSecret"`
	}
	if err := json.Unmarshal(raw, &secret); err != nil || len(secret.MasterSecret) < 16 {
		t.Fatalf("the workspace's master secret: %v", err)
	}
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	var names []string
	manifest := ""
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		name := h.Name[strings.Index(h.Name, "/")+1:]
		names = append(names, name)
		if name == "MANIFEST.txt" {
			manifest = string(b)
		}
		if strings.Contains(string(b), secret.MasterSecret) {
			t.Errorf("%s holds the master secret", name)
		}
	}
	all := strings.Join(names, "\n")
	for _, want := range []string{"MANIFEST.txt", "records/machines.yaml", "status.json", "nodes/w1/bootstrapper.log", "nodes/cp1/bootstrapper.log", "logs/berth-system/berth-joinservice-"} {
		if !strings.Contains(all, want) {
			t.Errorf("the support archive has no %s:\n%s", want, all)
		}
	}
	t.Logf("the support archive's manifest:\n%s", manifest)
}
