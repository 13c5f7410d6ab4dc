package cli

import (
	"bytes"
	"context"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/workspace"
)

// writeSnapshot writes a master-secret.json for master and a snapshot sealed under it into dir.
func writeSnapshot(t *testing.T, dir string, master byte) (secretPath, snapPath string, keys *clusterkeys.Keys) {
	t.Helper()
	m, salt := bytes.Repeat([]byte{master}, 32), bytes.Repeat([]byte{4}, 32)
	keys, err := clusterkeys.New(m, salt)
	if err != nil {
		t.Fatal(err)
	}
	secretPath = filepath.Join(dir, "master-secret.json")
	if err := os.WriteFile(secretPath, workspace.EncodeSecret(m, salt), 0o600); err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	man := backup.Manifest{ClusterID: hex.EncodeToString(keys.ClusterID()), Taken: time.Unix(1_900_000_000, 0), KMS: backup.KMSKeysOf(keys, []uint32{1}, 1)}
	if _, err := backup.Seal(&buf, keys, man, strings.NewReader(strings.Repeat("etcd data ", 20000))); err != nil {
		t.Fatal(err)
	}
	snapPath = filepath.Join(dir, "etcd.berth-snapshot")
	if err := os.WriteFile(snapPath, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return secretPath, snapPath, keys
}

// berth restore refuses, before it contacts the node and before it writes the workspace, a snapshot
// that another master secret sealed, a damaged one, a missing flag, and a workspace that holds
// another cluster's master secret; each with a named cause and the usage exit code.
func TestRestoreRefusesBeforeTheNode(t *testing.T) {
	dir := t.TempDir()
	secret, snap, _ := writeSnapshot(t, dir, 3)
	otherDir := t.TempDir()
	otherSecret, _, _ := writeSnapshot(t, otherDir, 5)
	sealed, err := os.ReadFile(snap)
	if err != nil {
		t.Fatal(err)
	}
	cut := filepath.Join(dir, "cut.berth-snapshot")
	if err := os.WriteFile(cut, sealed[:len(sealed)-100], 0o600); err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(dir, "cluster.yaml")
	if err := os.WriteFile(config, []byte("kubernetesVersion: v1.37.2\ninitSecret: 00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	taken := t.TempDir()
	if err := os.WriteFile(filepath.Join(taken, workspace.MasterSecret), workspace.EncodeSecret(bytes.Repeat([]byte{5}, 32), bytes.Repeat([]byte{4}, 32)), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		args      []string
		workspace string
		want      string
	}{
		{"another cluster's secret", []string{"--from", snap, "--master-secret", otherSecret}, "", "does not open with this master secret"},
		{"cut snapshot", []string{"--from", cut, "--master-secret", secret}, "", "the snapshot is damaged"},
		{"no snapshot file", []string{"--from", filepath.Join(dir, "none"), "--master-secret", secret}, "", "no such file"},
		{"no --from", []string{"--master-secret", secret}, "", "restore needs --from and --master-secret"},
		{"a workspace of another cluster", []string{"--from", snap, "--master-secret", secret}, taken, "holds another cluster's master-secret.json"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ws := tc.workspace
			if ws == "" {
				ws = filepath.Join(t.TempDir(), "ws")
			}
			var out, errOut bytes.Buffer
			// Port 1 on loopback: a restore that got as far as the node would fail dialing, with
			// another message.
			args := append([]string{"restore", "--endpoint", "127.0.0.1:1", "--connect-timeout", "1s", "--insecure-skip-attestation",
				"--config", config, "--workspace", ws}, tc.args...)
			code := Execute(context.Background(), args, &out, &errOut)
			if code != exitUsage || !strings.Contains(errOut.String(), tc.want) {
				t.Fatalf("exit %d, stderr %q; want %d and %q", code, errOut.String(), exitUsage, tc.want)
			}
			if strings.Contains(errOut.String(), "Connecting to") {
				t.Error("the refused restore contacted the node")
			}
			if tc.workspace == "" {
				if _, err := os.Stat(filepath.Join(ws, workspace.MasterSecret)); !os.IsNotExist(err) {
					t.Errorf("the refused restore wrote the workspace's master secret: %v", err)
				}
			}
		})
	}
}

// A snapshot that opens gets as far as the node; the workspace then holds the snapshot's master
// secret, and a second attempt with the same workspace resumes with it.
func TestRestoreAdoptsTheSnapshotsSecret(t *testing.T) {
	dir := t.TempDir()
	secret, snap, _ := writeSnapshot(t, dir, 3)
	config := filepath.Join(dir, "cluster.yaml")
	if err := os.WriteFile(config, []byte("kubernetesVersion: v1.37.2\ninitSecret: 00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := checkSnapshot(snap, secret)
	if err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(snap); src.size != fi.Size() {
		t.Errorf("size %d, the file has %d bytes", src.size, fi.Size())
	}
	ws := filepath.Join(t.TempDir(), "ws")
	var errOut bytes.Buffer
	if _, _, err := adoptWorkspace(ws, src, &errOut); err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(secret)
	if got, _ := os.ReadFile(filepath.Join(ws, workspace.MasterSecret)); !bytes.Equal(got, want) {
		t.Errorf("the workspace's master secret is not the snapshot's")
	}
	if _, _, err := adoptWorkspace(ws, src, &errOut); err != nil || !strings.Contains(errOut.String(), "Resuming with the master secret") {
		t.Errorf("second adopt = %v, %q", err, errOut.String())
	}
}
