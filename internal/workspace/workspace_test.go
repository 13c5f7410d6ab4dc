package workspace

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/clusterkeys"
)

func writeSecret(t *testing.T, dir string, master, salt []byte) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, MasterSecret), EncodeSecret(master, salt), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestUnfinished(t *testing.T) {
	dir := t.TempDir()
	if keys, err := Unfinished(dir); keys != nil || err != nil {
		t.Fatalf("empty workspace: %v, %v", keys, err)
	}
	master, salt := bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 32)
	writeSecret(t, dir, master, salt)
	want, _ := clusterkeys.New(master, salt)
	keys, err := Unfinished(dir)
	if err != nil || keys == nil || !bytes.Equal(keys.ClusterID(), want.ClusterID()) {
		t.Fatalf("workspace with a master secret: %v, %v; want the cluster %x", keys, err, want.ClusterID())
	}
	if err := os.WriteFile(filepath.Join(dir, AdminConf), []byte("kind: Config\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if keys, err := Unfinished(dir); keys != nil || err != nil {
		t.Fatalf("finished workspace: %v, %v; want no unfinished attempt", keys, err)
	}
	damaged := t.TempDir()
	writeSecret(t, damaged, []byte("short"), salt)
	if _, err := Unfinished(damaged); err == nil {
		t.Fatal("damaged master secret: no error")
	}
}

// PrepareSecret writes a new secret once (mode 0600), returns the same one on the next call, and
// refuses a finished workspace.
func TestPrepareSecret(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ws")
	master, salt, resumed, err := PrepareSecret(dir)
	if err != nil || resumed || len(master) != 32 || len(salt) != 32 {
		t.Fatalf("PrepareSecret() = %d, %d bytes, resumed %v, %v", len(master), len(salt), resumed, err)
	}
	for path, mode := range map[string]os.FileMode{dir: 0o700, filepath.Join(dir, MasterSecret): 0o600} {
		if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != mode {
			t.Errorf("%s: %v, %v; want mode %v", path, fi, err, mode)
		}
	}
	m2, s2, resumed, err := PrepareSecret(dir)
	if err != nil || !resumed || !bytes.Equal(m2, master) || !bytes.Equal(s2, salt) {
		t.Fatalf("second PrepareSecret() = resumed %v, same secret %v, %v", resumed, bytes.Equal(m2, master) && bytes.Equal(s2, salt), err)
	}
	got, gotSalt, ok, err := ReadSecret(dir)
	if err != nil || !ok || !bytes.Equal(got, master) || !bytes.Equal(gotSalt, salt) {
		t.Fatalf("ReadSecret() = ok %v, %v", ok, err)
	}
	if _, err := WriteResult(dir, []byte("kind: Config\n"), []byte{0xab, 0xcd}); err != nil {
		t.Fatal(err)
	}
	if _, _, _, err := PrepareSecret(dir); !errors.Is(err, ErrFinished) {
		t.Fatalf("PrepareSecret() in a finished workspace = %v, want ErrFinished", err)
	}
	if err := Create(dir); !errors.Is(err, ErrFinished) {
		t.Fatalf("Create() of a finished workspace = %v, want ErrFinished", err)
	}
}

// WriteResult never overwrites a finished cluster's kubeconfig.
func TestWriteResult(t *testing.T) {
	dir := t.TempDir()
	path, err := WriteResult(dir, []byte("first"), []byte{0x01, 0xfe})
	if err != nil || path != filepath.Join(dir, AdminConf) {
		t.Fatalf("WriteResult() = %s, %v", path, err)
	}
	if id, err := os.ReadFile(filepath.Join(dir, ClusterID)); err != nil || string(id) != "01fe\n" {
		t.Errorf("cluster-id = %q, %v", id, err)
	}
	if _, err := WriteResult(dir, []byte("second"), []byte{0x02}); err == nil {
		t.Fatal("second WriteResult() = nil error")
	}
	if data, _ := os.ReadFile(path); string(data) != "first" {
		t.Errorf("admin.conf = %q, want the first", data)
	}
}

func TestLoadKeys(t *testing.T) {
	dir := t.TempDir()
	master, salt := bytes.Repeat([]byte{3}, 32), bytes.Repeat([]byte{4}, 32)
	writeSecret(t, dir, master, salt)
	keys, err := LoadKeys(filepath.Join(dir, MasterSecret))
	want, _ := clusterkeys.New(master, salt)
	if err != nil || !bytes.Equal(keys.ClusterID(), want.ClusterID()) {
		t.Fatalf("LoadKeys() = %v", err)
	}
	for name, tc := range map[string]struct{ content, want string }{
		"not JSON":     {"master", "is not a master-secret.json"},
		"not base64":   {`{"masterSecret": "!!", "salt": "!!"}`, "must be base64"},
		"short secret": {`{"masterSecret": "AAAA", "salt": "AAAA"}`, "want a 32-byte master secret"},
	} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := LoadKeys(path); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: LoadKeys() = %v, want %q", name, err, tc.want)
		}
	}
	if _, err := LoadKeys(filepath.Join(dir, "missing")); err == nil {
		t.Error("LoadKeys() of a missing file = nil error")
	}
}

// The join policy is public (mode 0644) and replaced whole: no temporary file stays.
func TestWriteJoinPolicy(t *testing.T) {
	dir := t.TempDir()
	for _, content := range []string{"variant: tpm\n", "variant: tdx\n"} {
		path, err := WriteJoinPolicy(dir, []byte(content))
		if err != nil {
			t.Fatal(err)
		}
		if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o644 || path != filepath.Join(dir, JoinPolicy) {
			t.Errorf("written %s: %v %v", path, fi, err)
		}
		if data, _ := os.ReadFile(path); string(data) != content {
			t.Errorf("join policy = %q, want %q", data, content)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(dir, JoinPolicy+".*")); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
}
