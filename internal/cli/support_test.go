package cli

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/apiservertest"
)

// TestSupportWritesAnArchive: berth support against a real API server writes a 0600 archive with
// berth status's report and the records, names a mini cluster's node logs, refuses to replace a file
// without --force, and refuses a --mini-dir that is none.
func TestSupportWritesAnArchive(t *testing.T) {
	env := apiservertest.Shared(t)
	if err := env.InstallBerth(context.Background(), "variant: tpm\n"); err != nil {
		t.Fatal(err)
	}
	kc, err := env.WriteKubeconfig(apiservertest.AdminUser)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	mini := filepath.Join(dir, "mini")
	logDir := filepath.Join(mini, "nodes", "w1", "logs")
	if err := os.MkdirAll(logDir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(logDir, "bootstrapper.log"), []byte("line 1\nline 2\nline 3 Bearer abcdefgh12345678\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "bundle.tar.gz")
	var stdout, stderr bytes.Buffer
	if code := Execute(context.Background(), []string{"support", "--kubeconfig", kc, "--out", out, "--mini-dir", mini, "--tail-lines", "2"}, &stdout, &stderr); code != exitOK {
		t.Fatalf("berth support: exit %d\n%s%s", code, stdout.String(), stderr.String())
	}
	if !strings.Contains(stdout.String(), "Wrote "+out) || !strings.Contains(stdout.String(), "Redacted 1 values") {
		t.Errorf("summary:\n%s", stdout.String())
	}
	st, err := os.Stat(out)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("the archive: %v, mode %v; want 0600", err, st.Mode())
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	gz, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	files := map[string]string{}
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		files[h.Name[strings.Index(h.Name, "/")+1:]] = string(b)
	}
	if !strings.Contains(files["status.json"], `"namespace": "berth-system"`) {
		t.Errorf("status.json: %.300s", files["status.json"])
	}
	if _, ok := files["records/machines.yaml"]; !ok {
		t.Errorf("no records in the archive")
	}
	if got := files["nodes/w1/bootstrapper.log"]; got != "line 2\nline 3 Bearer [REDACTED]\n" {
		t.Errorf("w1's bootstrapper log = %q, want its last 2 lines, redacted", got)
	}

	stdout.Reset()
	stderr.Reset()
	if code := Execute(context.Background(), []string{"support", "--kubeconfig", kc, "--out", out}, &stdout, &stderr); code != exitUsage || !strings.Contains(stderr.String(), "pass --force") {
		t.Errorf("over an existing archive: exit %d, want %d and --force named\n%s", code, exitUsage, stderr.String())
	}
	if code := Execute(context.Background(), []string{"support", "--kubeconfig", kc, "--out", filepath.Join(dir, "b2.tar.gz"), "--mini-dir", dir}, &stdout, &stderr); code != exitUsage {
		t.Errorf("--mini-dir without nodes: exit %d, want %d", code, exitUsage)
	}
}
