package registry

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/apiservertest"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/machines"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

// installed returns the joinservice's client of a shared API server with berth-system installed.
func installed(t *testing.T) (admin, joinservice kubernetes.Interface) {
	t.Helper()
	env := apiservertest.Shared(t)
	if err := env.InstallBerth(context.Background(), "variant: insecure-none\n"); err != nil {
		t.Fatal(err)
	}
	return env.Client(t, apiservertest.AdminUser), env.Client(t, apiservertest.JoinServiceUser)
}

func run(t *testing.T, r *Registry) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	if err := wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) { return r.Synced(), nil }); err != nil {
		t.Fatal("the registry never synced")
	}
}

// eventually waits until cond holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if err := wait.PollUntilContextTimeout(context.Background(), 20*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) { return cond(), nil }); err != nil {
		t.Fatalf("%s: never happened", what)
	}
}

// TestAdmitRemoveOnAPIServer: the joinservice's admissions reach the record (as its own
// ServiceAccount, through the Role berth init installs); an operator's removal reaches every
// lookup; admitting a removed machine again leaves it removed; re-admission lifts it.
func TestAdmitRemoveOnAPIServer(t *testing.T) {
	admin, js := installed(t)
	ctx := context.Background()
	r := New(js, joinconfig.Namespace, zaptest.NewLogger(t))
	if _, _, err := r.Lookup("aa"); !errors.Is(err, ErrNotSynced) {
		t.Fatalf("Lookup before the record was read = %v, want ErrNotSynced", err)
	}
	run(t, r)
	w1 := machines.Machine{Identity: "aa01", Node: "w1", Role: machines.RoleWorker, Admitted: time.Now().UTC().Truncate(time.Second)}
	cp2 := machines.Machine{Identity: "bb02", Node: "cp2", Role: machines.RoleControlPlane, Admitted: time.Now().UTC().Truncate(time.Second)}
	r.Admit(w1)
	r.Admit(cp2)
	r.Admit(w1)
	eventually(t, "admissions in the record", func() bool {
		ms, err := machines.Read(ctx, admin, joinconfig.Namespace)
		return err == nil && machines.Index(ms, "aa01") >= 0 && machines.Index(ms, "bb02") >= 0
	})
	eventually(t, "admissions in the cache", func() bool { _, ok, _ := r.Lookup("aa01"); return ok })

	// The operator removes w1 (as berth node remove does).
	if _, err := machines.Update(ctx, admin, joinconfig.Namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
		ms[machines.Index(ms, "aa01")].Removal = &machines.Removal{Time: time.Now().UTC()}
		return ms, nil
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the removal in the cache", func() bool { m, _, _ := r.Lookup("aa01"); return m.Revoked() })
	r.Admit(w1)
	r.qmu.Lock()
	queued := len(r.queue)
	r.qmu.Unlock()
	if queued != 0 {
		t.Fatalf("admitting a recorded machine queued %d writes", queued)
	}
	// Even a write of it (a replica whose cache lagged) leaves the removal.
	r.qmu.Lock()
	r.queue[w1.Identity] = w1
	r.qmu.Unlock()
	if err := r.flush(ctx); err != nil {
		t.Fatal(err)
	}
	if m, _, _ := r.Lookup("aa01"); !m.Revoked() {
		t.Fatal("admitting a removed machine again lifted its removal")
	}
	ms, _ := machines.Read(ctx, admin, joinconfig.Namespace)
	if len(ms) != 2 {
		t.Fatalf("record holds %d machines, want 2: %+v", len(ms), ms)
	}
}

// TestEtcdRemovalStates: a pending control-plane removal is listed, SetEtcd records its outcome once
// (a second replica's outcome changes nothing), and nothing happens for a machine not pending.
func TestEtcdRemovalStates(t *testing.T) {
	admin, js := installed(t)
	ctx := context.Background()
	if _, err := machines.Update(ctx, admin, joinconfig.Namespace, func(ms []machines.Machine) ([]machines.Machine, error) {
		ms, _ = machines.Admit(ms,
			machines.Machine{Identity: "cc03", Node: "cp3", Role: machines.RoleControlPlane, Removal: &machines.Removal{Time: time.Now().UTC(), Etcd: machines.EtcdPending}},
			machines.Machine{Identity: "dd04", Node: "w4", Role: machines.RoleWorker, Removal: &machines.Removal{Time: time.Now().UTC()}})
		return ms, nil
	}); err != nil {
		t.Fatal(err)
	}
	r := New(js, joinconfig.Namespace, zaptest.NewLogger(t))
	run(t, r)
	eventually(t, "the pending removal listed", func() bool {
		rs := r.Removals()
		return len(rs) == 1 && rs[0].Identity == "cc03"
	})
	if err := r.SetEtcd(ctx, "cc03", machines.EtcdPending, "etcd has no quorum"); err != nil {
		t.Fatal(err)
	}
	if err := r.SetEtcd(ctx, "cc03", machines.EtcdRemoved, ""); err != nil {
		t.Fatal(err)
	}
	if err := r.SetEtcd(ctx, "cc03", machines.EtcdAbsent, "a second replica"); err != nil {
		t.Fatal(err)
	}
	if err := r.SetEtcd(ctx, "dd04", machines.EtcdRemoved, ""); err != nil {
		t.Fatal(err)
	}
	ms, _ := machines.Read(ctx, admin, joinconfig.Namespace)
	cp3, w4 := ms[machines.Index(ms, "cc03")], ms[machines.Index(ms, "dd04")]
	if cp3.Removal.Etcd != machines.EtcdRemoved || cp3.Removal.EtcdMessage != "" || w4.Removal.Etcd != "" {
		t.Fatalf("cp3 removal %+v, w4 removal %+v", cp3.Removal, w4.Removal)
	}
	eventually(t, "no pending removal left", func() bool { return len(r.Removals()) == 0 })
}

// TestUnreadableRecordKeepsTheCache: a record that does not decode never empties the cache (which
// would lift every removal).
func TestUnreadableRecordKeepsTheCache(t *testing.T) {
	r := New(nil, "ns", zaptest.NewLogger(t))
	r.load(&corev1.ConfigMap{Data: map[string]string{machines.DataKey: `[{"identity":"aa","node":"w1","removal":{"time":"2026-11-25T06:00:00Z"}}]`}})
	r.synced.Store(true)
	r.load(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "x"}, Data: map[string]string{machines.DataKey: "[{"}})
	if m, ok, err := r.Lookup("aa"); err != nil || !ok || !m.Revoked() {
		t.Fatalf("after an unreadable record: %+v %v %v", m, ok, err)
	}
}

// TestOnChangeSeesWrites: the change hook gets the record after the registry's own writes (the
// record writer copies removals from it).
func TestOnChangeSeesWrites(t *testing.T) {
	_, js := installed(t)
	r := New(js, joinconfig.Namespace, zaptest.NewLogger(t))
	seen := make(chan []machines.Machine, 16)
	r.OnChange(func(ms []machines.Machine) {
		select {
		case seen <- ms:
		default:
		}
	})
	run(t, r)
	id := "instance/onchange-" + time.Now().Format("150405.000000")
	r.Admit(machines.Machine{Identity: id, Node: "w-onchange", Role: machines.RoleWorker, Admitted: time.Now().UTC().Truncate(time.Second)})
	timeout := time.After(30 * time.Second)
	for {
		select {
		case ms := <-seen:
			if machines.Index(ms, id) >= 0 {
				return
			}
		case <-timeout:
			t.Fatal("the change hook never saw the admitted machine")
		}
	}
}
