package backup

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/proctest"
)

// TestRestoreIntoRealEtcd takes a snapshot of a real API server's etcd holding a canary Secret,
// restores it with the master secret into a new data directory, starts a real etcd on it, and
// reads the canary back there; the revision moved past the old cluster's. A wrong master secret
// and a cut snapshot write nothing.
func TestRestoreIntoRealEtcd(t *testing.T) {
	env := apiservertest.Shared(t)
	etcdBin, err := apiservertest.EtcdBinary()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const canary = "restore-canary-51c2e0"
	client := env.Client(t, apiservertest.AdminUser)
	ns := "restore-" + time.Now().Format("150405")
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "canary"},
		Data: map[string][]byte{"v": []byte(canary)}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	src, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	keys := testKeys(t, 1)
	taken, err := Take(ctx, src, keys, KMSKeysOf(keys, []uint32{1}, 1), t.TempDir(), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := os.ReadFile(taken.Path)
	if err != nil {
		t.Fatal(err)
	}
	oldRev, err := src.Get(ctx, "/registry/secrets/"+ns+"/canary")
	if err != nil {
		t.Fatal(err)
	}

	root := t.TempDir()
	peer := "http://" + proctest.FreeAddr(t)
	member := Member{Name: "cp-restored", PeerURL: peer}
	log := zaptest.NewLogger(t)
	t.Run("wrong secret", func(t *testing.T) {
		dir := filepath.Join(root, "wrong")
		if _, err := Restore(bytes.NewReader(sealed), testKeys(t, 9), member, dir, log); !errors.Is(err, ErrWrongSecret) {
			t.Fatalf("Restore with another master secret = %v, want ErrWrongSecret", err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("a refused restore left %s: %v", dir, err)
		}
	})
	t.Run("cut snapshot", func(t *testing.T) {
		dir := filepath.Join(root, "cut")
		if _, err := Restore(bytes.NewReader(sealed[:len(sealed)-100]), keys, member, dir, log); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Restore of a cut snapshot = %v, want ErrCorrupt", err)
		}
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("a refused restore left %s: %v", dir, err)
		}
	})

	dataDir := filepath.Join(root, "etcd")
	man, err := Restore(bytes.NewReader(sealed), keys, member, dataDir, log)
	if err != nil {
		t.Fatalf("Restore = %v", err)
	}
	if k, ok := man.KMS.Key(1); !ok || !bytes.Equal(k, keys.KMSKey(1)) {
		t.Error("the restored manifest lacks the KMS key")
	}
	if _, err := Restore(bytes.NewReader(sealed), keys, member, dataDir, log); !errors.Is(err, ErrDataDirExists) {
		t.Errorf("a second Restore into the same directory = %v, want ErrDataDirExists", err)
	}

	clientURL := "http://" + proctest.FreeAddr(t)
	p := proctest.Start(t, proctest.Cmd{Name: "restored-etcd", Path: etcdBin, Args: []string{
		"--name", member.Name, "--data-dir", dataDir,
		"--listen-client-urls", clientURL, "--advertise-client-urls", clientURL,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", member.Name + "=" + peer, "--initial-cluster-state", "new",
	}})
	restored, err := clientv3.New(clientv3.Config{Endpoints: []string{clientURL}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer restored.Close()
	var got *clientv3.GetResponse
	if err := proctest.WaitReady(ctx, 100*time.Millisecond, time.Minute, func(ctx context.Context) error {
		c, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		got, err = restored.Get(c, "/registry/secrets/"+ns+"/canary")
		return err
	}, p); err != nil {
		t.Fatal(err)
	}
	if len(got.Kvs) != 1 || !bytes.Contains(got.Kvs[0].Value, []byte(canary)) {
		t.Fatalf("the restored etcd holds %d values for the canary", len(got.Kvs))
	}
	if got.Header.Revision < oldRev.Header.Revision+RevisionBump {
		t.Errorf("restored revision %d, want at least %d past the old %d", got.Header.Revision, RevisionBump, oldRev.Header.Revision)
	}
}
