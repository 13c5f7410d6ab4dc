package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/workspace"
)

// TestBackupNow: berth backup now against a real API server and etcd, with the schedule running as
// a joinservice replica runs it: the snapshot is taken and reported, a failing store fails the
// command with the schedule's error, and without a schedule the command ends at its timeout.
func TestBackupNow(t *testing.T) {
	env := apiservertest.Shared(t)
	client := env.Client(t, apiservertest.AdminUser)
	ctx := context.Background()
	ns := fmt.Sprintf("backup-now-%d", time.Now().UnixNano()%1e9)
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	_, err := backupNow(short, client, ns)
	cancel()
	if err == nil || !strings.Contains(err.Error(), "is a joinservice running") {
		t.Fatalf("backup now without a schedule = %v", err)
	}

	keys, err := clusterkeys.New(bytes.Repeat([]byte{3}, 32), bytes.Repeat([]byte{4}, 32))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	stores := []backup.Store{backup.NewDir(dir)}
	sctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- (&backup.Schedule{
			Log: zaptest.NewLogger(t), Client: client, Namespace: ns, Identity: "cp-1", Keys: keys,
			Etcd: func(context.Context) (backup.Snapshotter, io.Closer, error) {
				c, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 5 * time.Second})
				return c, c, err
			},
			KMS:    func(context.Context) ([]uint32, uint32, error) { return []uint32{1}, 1, nil },
			Stores: stores, Staging: t.TempDir(), Poll: 20 * time.Millisecond,
		}).Run(sctx)
	}()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("schedule: %v", err)
		}
	}()

	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	st, err := backupNow(wctx, client, ns)
	if err != nil || st.LastSuccess == nil {
		t.Fatalf("backup now = %+v, %v", st, err)
	}
	r, err := readBackupSection(ctx, client, ns, time.Now())
	if err != nil || r.Stale || r.LastSuccess == nil || r.LastSuccess.Name != st.LastSuccess.Name {
		t.Fatalf("backup section = %+v, %v", r, err)
	}
	var out bytes.Buffer
	printBackupSection(&out, r, nil)
	if !strings.Contains(out.String(), st.LastSuccess.Name) || strings.Contains(out.String(), "WARNING") {
		t.Errorf("backup section:\n%s", out.String())
	}
	// Two intervals later the same status is stale.
	r, _ = readBackupSection(ctx, client, ns, time.Now().Add(2*backup.DefaultInterval+time.Minute))
	out.Reset()
	printBackupSection(&out, r, nil)
	if !r.Stale || !strings.Contains(out.String(), "WARNING: stale") {
		t.Errorf("a snapshot two intervals old:\n%s", out.String())
	}

	// berth backup verify: the right master secret opens it, another one is refused by name.
	snap := filepath.Join(dir, st.LastSuccess.Name)
	good, bad := filepath.Join(t.TempDir(), "good.json"), filepath.Join(t.TempDir(), "bad.json")
	if err := os.WriteFile(good, workspace.EncodeSecret(bytes.Repeat([]byte{3}, 32), bytes.Repeat([]byte{4}, 32)), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, workspace.EncodeSecret(bytes.Repeat([]byte{5}, 32), bytes.Repeat([]byte{4}, 32)), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := NewRootCmd()
	out.Reset()
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"backup", "verify", "--master-secret", good, snap})
	if err := cmd.ExecuteContext(ctx); err != nil || !strings.Contains(out.String(), "opens with this master secret") {
		t.Fatalf("verify with the master secret = %v:\n%s", err, out.String())
	}
	cmd = NewRootCmd()
	cmd.SetOut(io.Discard)
	cmd.SetArgs([]string{"backup", "verify", "--master-secret", bad, snap})
	if err := cmd.ExecuteContext(ctx); !errors.Is(err, backup.ErrWrongSecret) {
		t.Fatalf("verify with another master secret = %v, want ErrWrongSecret", err)
	}

	// berth backup restore-etcd: another master secret writes nothing; the right one restores.
	dataDir := filepath.Join(t.TempDir(), "etcd")
	restoreArgs := func(secret string) []string {
		return []string{"backup", "restore-etcd", "--master-secret", secret, "--data-dir", dataDir,
			"--name", "cp1", "--peer-url", "https://127.0.0.1:2380", snap}
	}
	cmd = NewRootCmd()
	cmd.SetOut(io.Discard)
	cmd.SetArgs(restoreArgs(bad))
	if err := cmd.ExecuteContext(ctx); !errors.Is(err, backup.ErrWrongSecret) {
		t.Fatalf("restore-etcd with another master secret = %v, want ErrWrongSecret", err)
	}
	if _, err := os.Stat(dataDir); !os.IsNotExist(err) {
		t.Fatalf("a refused restore-etcd left %s: %v", dataDir, err)
	}
	cmd = NewRootCmd()
	out.Reset()
	cmd.SetOut(&out)
	cmd.SetArgs(restoreArgs(good))
	if err := cmd.ExecuteContext(ctx); err != nil || !strings.Contains(out.String(), "restored into") {
		t.Fatalf("restore-etcd = %v:\n%s", err, out.String())
	}
	if _, err := os.Stat(filepath.Join(dataDir, "member", "snap", "db")); err != nil {
		t.Errorf("restore-etcd made no etcd database: %v", err)
	}

	// A store that fails makes the command fail with the schedule's error.
	// (The store's directory becomes a file: not even root writes into it.)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := backupNow(wctx, client, ns); !errors.Is(err, errBackupFailed) {
		t.Errorf("backup now into a broken store = %v, want errBackupFailed", err)
	}
}
