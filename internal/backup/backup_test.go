package backup

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/backup/backuptest"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

func testKeys(t testing.TB, b byte) *clusterkeys.Keys {
	t.Helper()
	k, err := clusterkeys.New(bytes.Repeat([]byte{b}, 32), bytes.Repeat([]byte{2}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func sealBytes(t *testing.T, keys *clusterkeys.Keys, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	m := Manifest{ClusterID: "c1", Taken: time.Unix(1000, 0).UTC(), KMS: KMSKeysOf(keys, []uint32{1, 2}, 2)}
	if _, err := Seal(&buf, keys, m, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestSealOpen(t *testing.T) {
	keys := testKeys(t, 1)
	data := bytes.Repeat([]byte("etcd data "), 30000) // several of age's chunks
	sealed := sealBytes(t, keys, data)
	m, r, err := Open(bytes.NewReader(sealed), keys)
	if err != nil {
		t.Fatalf("Open = %v", err)
	}
	got, err := io.ReadAll(r)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the etcd snapshot read back differs (%d bytes of %d, %v)", len(got), len(data), err)
	}
	if k, ok := m.KMS.Key(2); !ok || !bytes.Equal(k, keys.KMSKey(2)) || m.KMS.Active != 2 {
		t.Errorf("manifest's KMS keys: %v", m.KMS)
	}
	if _, ok := m.KMS.Key(1); !ok {
		t.Error("the older generation's key is missing")
	}

	t.Run("wrong secret", func(t *testing.T) {
		if _, _, err := Open(bytes.NewReader(sealed), testKeys(t, 9)); !errors.Is(err, ErrWrongSecret) {
			t.Fatalf("Open with another master secret = %v, want ErrWrongSecret", err)
		}
	})
	t.Run("changed byte", func(t *testing.T) {
		// Every region: the header (stanza, MAC), the manifest's chunk, a middle chunk, the last one.
		for _, at := range []int{20, 150, len(sealed) / 2, len(sealed) - 5} {
			bad := bytes.Clone(sealed)
			bad[at] ^= 1
			if err := openAll(bad, keys); !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrWrongSecret) {
				t.Errorf("a byte changed at %d of %d: %v, want ErrCorrupt or ErrWrongSecret", at, len(sealed), err)
			}
		}
	})
	t.Run("cut short", func(t *testing.T) {
		for _, n := range []int{len(sealed) - 1, len(sealed) - 64<<10, 200} {
			if err := openAll(sealed[:n], keys); !errors.Is(err, ErrCorrupt) {
				t.Errorf("cut to %d of %d bytes: %v, want ErrCorrupt", n, len(sealed), err)
			}
		}
	})
	t.Run("not a snapshot", func(t *testing.T) {
		if err := openAll([]byte("hello"), keys); !errors.Is(err, ErrCorrupt) {
			t.Errorf("Open(garbage) = %v, want ErrCorrupt", err)
		}
	})
	t.Run("no KMS keys", func(t *testing.T) {
		if _, err := Seal(io.Discard, keys, Manifest{}, bytes.NewReader(nil)); err == nil {
			t.Error("Seal without KMS keys succeeded")
		}
	})
}

func openAll(b []byte, keys *clusterkeys.Keys) error {
	_, r, err := Open(bytes.NewReader(b), keys)
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, r)
	return err
}

func TestKMSKeysNeverPrinted(t *testing.T) {
	k := KMSKeysOf(testKeys(t, 1), []uint32{1}, 1)
	for _, s := range []string{k.String(), k.GoString()} {
		if bytes.Contains([]byte(s), k.Keys["1"]) || bytes.Contains([]byte(s), []byte(base64.StdEncoding.EncodeToString(k.Keys["1"]))) {
			t.Errorf("%q prints a key", s)
		}
	}
}

func TestNames(t *testing.T) {
	at := time.Date(2030, 1, 2, 3, 4, 5, 6e6, time.UTC)
	n := Name(at)
	got, err := ParseName(n)
	if err != nil || !got.Equal(at) {
		t.Fatalf("ParseName(%q) = %v, %v", n, got, err)
	}
	if Name(at) >= Name(at.Add(time.Millisecond)) {
		t.Error("names do not sort by time")
	}
	for _, bad := range []string{"../" + n, "etcd-x" + Suffix, "etcd-20300102T030405.006Z.tmp", "", "/etc/passwd"} {
		if _, err := ParseName(bad); !errors.Is(err, ErrBadName) {
			t.Errorf("ParseName(%q) = %v, want ErrBadName", bad, err)
		}
	}
}

// TestTakeFromRealEtcd takes a snapshot of a real API server's etcd that holds a canary Secret in
// plain text (no KMS here, so that the test can see the canary where it would leak): etcd's own
// snapshot contains it, the sealed one does not in any encoding, and the sealed one opens back into
// etcd's snapshot byte for byte.
func TestTakeFromRealEtcd(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const canary = "canary-7f3a9c-the-value-no-snapshot-may-show"
	client := env.Client(t, apiservertest.AdminUser)
	ns := "backup-canary-" + time.Now().Format("150405.000")[7:]
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "canary"},
		Data: map[string][]byte{"v": []byte(canary)}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	etcd, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer etcd.Close()

	keys := testKeys(t, 1)
	dir := t.TempDir()
	taken, err := Take(ctx, etcd, keys, KMSKeysOf(keys, []uint32{1}, 1), dir, time.Now())
	if err != nil {
		t.Fatalf("Take = %v", err)
	}
	if taken.EtcdSize == 0 {
		t.Errorf("Take = %+v, want a size", taken)
	}
	sealed, err := os.ReadFile(taken.Path)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(sealed)) != taken.Size {
		t.Errorf("Size = %d, the file has %d bytes", taken.Size, len(sealed))
	}
	m, r, err := Open(bytes.NewReader(sealed), keys)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	if int64(len(raw)) != taken.EtcdSize || m.ClusterID != hex.EncodeToString(keys.ClusterID()) {
		t.Errorf("manifest of cluster %s, %d etcd bytes (took %d)", m.ClusterID, len(raw), taken.EtcdSize)
	}
	// The value as etcd stores it (here the Secret's protobuf; under KMS, the envelope): no 32 bytes
	// of it are in the sealed file.
	stored, err := etcd.Get(ctx, "/registry/secrets/"+ns+"/canary")
	if err != nil || len(stored.Kvs) != 1 {
		t.Fatalf("reading the canary from etcd: %v", err)
	}
	value := stored.Kvs[0].Value
	if !bytes.Contains(raw, value) {
		t.Fatal("etcd's own snapshot lacks the canary as etcd stores it")
	}
	for i := 0; i+32 <= len(value); i += 16 {
		if bytes.Contains(sealed, value[i:i+32]) {
			t.Fatalf("the sealed snapshot contains bytes %d..%d of the canary as etcd stores it", i, i+32)
		}
	}
	for enc, b := range backuptest.Encodings(canary) {
		if enc == "plain" && !bytes.Contains(raw, b) {
			t.Fatalf("etcd's own snapshot has no plain canary: the check below could not see one")
		}
		if bytes.Contains(sealed, b) {
			t.Errorf("the sealed snapshot contains the canary (%s)", enc)
		}
	}
	// A Dir store keeps it under its name, lists and prunes it.
	store := NewDir(filepath.Join(dir, "store"))
	if err := PutFile(ctx, store, taken); err != nil {
		t.Fatal(err)
	}
	objs, err := store.List(ctx)
	if err != nil || len(objs) != 1 || objs[0].Name != taken.Name || objs[0].Size != taken.Size {
		t.Fatalf("List = %+v, %v", objs, err)
	}
}

func TestDirStore(t *testing.T) {
	testStore(t, NewDir(t.TempDir()))
}

// testStore checks a Store: put, list in order, get, prune to keep, names refused.
func testStore(t *testing.T, s Store) {
	t.Helper()
	ctx := context.Background()
	base := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range 7 {
		body := []byte{byte(i), 1, 2, 3}
		if err := s.Put(ctx, Name(base.Add(time.Duration(6-i)*time.Hour)), bytes.NewReader(body), int64(len(body))); err != nil {
			t.Fatalf("Put %d: %v", i, err)
		}
	}
	objs, err := s.List(ctx)
	if err != nil || len(objs) != 7 {
		t.Fatalf("List = %d objects, %v", len(objs), err)
	}
	for i, o := range objs {
		if !o.Taken.Equal(base.Add(time.Duration(i)*time.Hour)) || o.Size != 4 {
			t.Errorf("object %d: %+v", i, o)
		}
	}
	rc, err := s.Get(ctx, objs[0].Name)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(got, []byte{6, 1, 2, 3}) {
		t.Errorf("Get = %v, %v", got, err)
	}
	if _, err := s.Get(ctx, Name(base.Add(-time.Hour))); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get(missing) = %v, want ErrNotFound", err)
	}
	gone, err := Prune(ctx, s, 5)
	if err != nil || len(gone) != 2 || gone[0] != objs[0].Name || gone[1] != objs[1].Name {
		t.Fatalf("Prune = %v, %v; want the two oldest", gone, err)
	}
	if objs, _ = s.List(ctx); len(objs) != 5 {
		t.Errorf("after Prune: %d objects, want 5", len(objs))
	}
	if err := s.Put(ctx, "../escape", bytes.NewReader(nil), 0); !errors.Is(err, ErrBadName) {
		t.Errorf("Put(../escape) = %v, want ErrBadName", err)
	}
	if _, err := s.Get(ctx, "../escape"); !errors.Is(err, ErrBadName) {
		t.Errorf("Get(../escape) = %v, want ErrBadName", err)
	}
}
