package backup_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/backup/s3test"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
)

var nsSeq atomic.Int32

func newNamespace(t *testing.T, client kubernetes.Interface) string {
	t.Helper()
	ns := fmt.Sprintf("backup-schedule-%d-%d", time.Now().UnixNano()%1e6, nsSeq.Add(1))
	if _, err := client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return ns
}

func etcdOf(env *apiservertest.Env) backup.EtcdFunc {
	return func(context.Context) (backup.Snapshotter, io.Closer, error) {
		c, err := clientv3.New(clientv3.Config{Endpoints: []string{env.EtcdURL()}, DialTimeout: 5 * time.Second})
		if err != nil {
			return nil, nil, err
		}
		return c, c, nil
	}
}

func keysOf(t *testing.T) *clusterkeys.Keys {
	k, err := clusterkeys.New(bytes.Repeat([]byte{7}, 32), bytes.Repeat([]byte{8}, 32))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// waitStatus waits until the status satisfies ok.
func waitStatus(t *testing.T, client kubernetes.Interface, ns string, ok func(backup.Status) bool) backup.Status {
	t.Helper()
	var st backup.Status
	err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		var err error
		st, _, err = backup.ReadStatus(ctx, client, ns)
		return err == nil && ok(st), nil
	})
	if err != nil {
		t.Fatalf("waiting for the backup status: %v (last: %+v)", err, st)
	}
	return st
}

func runSchedule(t *testing.T, s *backup.Schedule) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	})
}

// TestSchedule runs the schedule against a real API server, etcd and object store: the first
// snapshot at once, more on request, every store pruned to Keep, the status and metrics telling.
func TestSchedule(t *testing.T) {
	env := apiservertest.Shared(t)
	client := env.Client(t, apiservertest.AdminUser)
	ns := newNamespace(t, client)
	s3cfg := s3test.Start(t)
	s3store, err := backup.NewS3(s3cfg)
	if err != nil {
		t.Fatal(err)
	}
	keys := keysOf(t)
	dir := backup.NewDir(t.TempDir())
	reg := prometheus.NewRegistry()
	m := backup.NewMetrics(reg)
	runSchedule(t, &backup.Schedule{
		Log: zaptest.NewLogger(t), Client: client, Namespace: ns, Identity: "cp-1", Etcd: etcdOf(env), Keys: keys,
		KMS:    func(context.Context) ([]uint32, uint32, error) { return []uint32{1, 2}, 2, nil },
		Stores: []backup.Store{dir, s3store}, Staging: t.TempDir(), Poll: 20 * time.Millisecond, Metrics: m,
	})

	st := waitStatus(t, client, ns, func(st backup.Status) bool { return st.LastSuccess != nil })
	if st.LastError != "" || st.Leader != "cp-1" || st.Keep != backup.DefaultKeep || st.Interval != backup.DefaultInterval || len(st.Stores) != 2 {
		t.Errorf("status after the first snapshot: %+v", st)
	}
	first := st.LastSuccess.Name
	// The stored snapshot opens with the master secret and carries the KMS keys.
	rc, err := s3store.Get(context.Background(), first)
	if err != nil {
		t.Fatal(err)
	}
	man, r, err := backup.Open(rc, keys)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, r); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if k, ok := man.KMS.Key(2); !ok || !bytes.Equal(k, keys.KMSKey(2)) || man.KMS.Active != 2 {
		t.Errorf("the snapshot's KMS keys: %v", man.KMS)
	}

	// Requests (berth backup now) take one each, until both stores hold Keep.
	for range backup.DefaultKeep + 1 {
		req, err := backup.Request(context.Background(), client, ns, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		waitStatus(t, client, ns, func(st backup.Status) bool { return !st.LastAttempt.Before(req) && st.LastSuccess != nil })
	}
	st = waitStatus(t, client, ns, func(backup.Status) bool { return true })
	for _, store := range []backup.Store{dir, s3store} {
		objs, err := store.List(context.Background())
		if err != nil || len(objs) != backup.DefaultKeep {
			t.Errorf("%s holds %d snapshots (%v), want %d", store, len(objs), err, backup.DefaultKeep)
		}
		for _, o := range objs {
			if o.Name == first {
				t.Errorf("%s still holds the oldest snapshot", store)
			}
		}
	}
	if len(st.Snapshots) != backup.DefaultKeep || st.Snapshots[len(st.Snapshots)-1].Name != st.LastSuccess.Name {
		t.Errorf("status lists %d snapshots, last %+v", len(st.Snapshots), st.LastSuccess)
	}
	if got := testutil.ToFloat64(m.Snapshots("ok")); got != backup.DefaultKeep+2 {
		t.Errorf("berth_backup_snapshots_total{result=ok} = %v, want %d", got, backup.DefaultKeep+2)
	}
	if err := testutil.CollectAndCompare(reg, strings.NewReader(fmt.Sprintf(`
# HELP berth_backup_last_size_bytes Sealed size of the last etcd snapshot written to every store.
# TYPE berth_backup_last_size_bytes gauge
berth_backup_last_size_bytes %d
`, st.LastSuccess.Size)), "berth_backup_last_size_bytes"); err != nil {
		t.Error(err)
	}
}

// TestScheduleStoreFails: a store that refuses (wrong credentials) fails the snapshot, says so in the
// status and the metrics, and the other store still gets it.
func TestScheduleStoreFails(t *testing.T) {
	env := apiservertest.Shared(t)
	client := env.Client(t, apiservertest.AdminUser)
	ns := newNamespace(t, client)
	cfg := s3test.Start(t)
	cfg.SecretKey = "not-the-secret"
	bad, err := backup.NewS3(cfg)
	if err != nil {
		t.Fatal(err)
	}
	dir := backup.NewDir(t.TempDir())
	m := backup.NewMetrics(prometheus.NewRegistry())
	runSchedule(t, &backup.Schedule{
		Log: zaptest.NewLogger(t), Client: client, Namespace: ns, Identity: "cp-1", Etcd: etcdOf(env), Keys: keysOf(t),
		KMS:    func(context.Context) ([]uint32, uint32, error) { return []uint32{1}, 1, nil },
		Stores: []backup.Store{dir, bad}, Staging: t.TempDir(), Poll: 20 * time.Millisecond, Metrics: m,
	})
	st := waitStatus(t, client, ns, func(st backup.Status) bool { return !st.LastAttempt.IsZero() })
	if st.LastSuccess != nil || !strings.Contains(st.LastError, "uploading") {
		t.Errorf("status after a refused upload: %+v", st)
	}
	if strings.Contains(st.LastError, "not-the-secret") {
		t.Error("the status shows the store's secret key")
	}
	if objs, _ := dir.List(context.Background()); len(objs) != 1 {
		t.Errorf("the directory holds %d snapshots, want 1", len(objs))
	}
	if got := testutil.ToFloat64(m.Snapshots("failed")); got < 1 {
		t.Errorf("berth_backup_snapshots_total{result=failed} = %v", got)
	}
}

func TestScheduleRefusesBadSettings(t *testing.T) {
	for name, s := range map[string]backup.Schedule{
		"interval over 6h": {Interval: 7 * time.Hour, Stores: []backup.Store{backup.NewDir(t.TempDir())}},
		"keep under 5":     {Keep: 4, Stores: []backup.Store{backup.NewDir(t.TempDir())}},
		"no store":         {},
	} {
		if err := s.Run(context.Background()); err == nil {
			t.Errorf("%s: Run = nil", name)
		}
	}
}

// TestScheduleAsJoinService runs the schedule with the joinservice's own identity and RBAC, as
// berth init installs them in berth-system: the Lease, the status and the requests need nothing
// the Role does not grant, and nothing else in berth-system is writable to it.
func TestScheduleAsJoinService(t *testing.T) {
	env := apiservertest.Shared(t)
	ctx := context.Background()
	if err := env.InstallBerth(ctx, "variant: insecure-none\n"); err != nil {
		t.Fatal(err)
	}
	js := env.Client(t, apiservertest.JoinServiceUser)
	admin := env.Client(t, apiservertest.AdminUser)
	runSchedule(t, &backup.Schedule{
		Log: zaptest.NewLogger(t), Client: js, Namespace: joinconfig.Namespace, Identity: "cp-1", Etcd: etcdOf(env), Keys: keysOf(t),
		KMS:    func(context.Context) ([]uint32, uint32, error) { return []uint32{1}, 1, nil },
		Stores: []backup.Store{backup.NewDir(t.TempDir())}, Staging: t.TempDir(), Poll: 20 * time.Millisecond,
	})
	st := waitStatus(t, admin, joinconfig.Namespace, func(st backup.Status) bool { return st.LastSuccess != nil })
	req, err := backup.Request(ctx, admin, joinconfig.Namespace, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	st = waitStatus(t, admin, joinconfig.Namespace, func(st backup.Status) bool { return !st.LastAttempt.Before(req) })
	if st.LastError != "" {
		t.Fatalf("the requested snapshot failed as the joinservice: %s", st.LastError)
	}
	// The joinservice may write the backup status, not other ConfigMaps by the same means.
	if err := backup.WriteStatus(ctx, js, "default", st); err == nil {
		t.Error("the joinservice wrote a backup status outside berth-system")
	}
}
