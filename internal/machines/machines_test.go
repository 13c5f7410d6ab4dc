package machines

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/berth-k8s/berth/internal/apiservertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(apiservertest.StoppingShared(m)) }

func at(sec int) time.Time { return time.Date(2026, 11, 25, 6, 0, sec, 0, time.UTC) }

func TestIdentity(t *testing.T) {
	if got := Identity([]byte{0xab, 0x01}, "w1"); got != "ab01" {
		t.Errorf("attested identity = %q, want its hex", got)
	}
	if got := Identity(nil, "w1"); got != "instance/w1" {
		t.Errorf("identity without attestation = %q, want instance/w1", got)
	}
	long := "0123456789abcdef0123456789abcdef"
	if Short(long) != "0123456789abcdef" || Short("instance/w1") != "instance/w1" {
		t.Errorf("Short: %q %q", Short(long), Short("instance/w1"))
	}
}

// TestAdmitNeverChangesARecordedMachine: a removed machine admitted again stays removed, and a known
// identity is not added twice.
func TestAdmitNeverChangesARecordedMachine(t *testing.T) {
	removed := Machine{Identity: "aa", Node: "w1", Role: RoleWorker, Admitted: at(1), Removal: &Removal{Time: at(2)}}
	ms, added := Admit([]Machine{removed}, Machine{Identity: "aa", Node: "w1", Admitted: at(3)}, Machine{Identity: "bb", Node: "w2", Admitted: at(3)}, Machine{Identity: "bb", Node: "w2"})
	if !added || len(ms) != 2 || !ms[0].Revoked() || ms[1].Identity != "bb" {
		t.Fatalf("Admit = %+v, %v", ms, added)
	}
	if _, added := Admit(ms, Machine{Identity: "bb"}); added {
		t.Error("Admit of a known identity added something")
	}
}

func TestRevokedAndByNode(t *testing.T) {
	ms := []Machine{
		{Identity: "old", Node: "w1", Admitted: at(1), Removal: &Removal{Time: at(2)}},
		{Identity: "new", Node: "w1", Admitted: at(5)},
		{Identity: "cp", Node: "cp2", Role: RoleControlPlane, Admitted: at(1), Removal: &Removal{Time: at(3), Etcd: EtcdRefused}},
	}
	if m, ok := ByNode(ms, "w1", false); !ok || m.Identity != "new" {
		t.Errorf("ByNode(w1) = %+v %v, want the machine that is not removed", m, ok)
	}
	if m, ok := ByNode(ms, "w1", true); !ok || m.Identity != "old" {
		t.Errorf("ByNode(w1, removed) = %+v %v, want the removed one", m, ok)
	}
	if m, ok := ByNode(ms, "cp2", false); !ok || m.Revoked() {
		t.Errorf("a machine whose etcd removal was refused counts as removed: %+v %v", m, ok)
	}
	if _, ok := ByNode(ms, "w9", false); ok {
		t.Error("ByNode found a node that never joined")
	}
	if Index(ms, "cp") != 2 || Index(ms, "x") != -1 {
		t.Error("Index")
	}
	// The API server's list: the removed w1 (once, though two of its machines are removed), not the
	// control plane whose removal was refused.
	ms = append(ms, Machine{Identity: "older", Node: "w1", Removal: &Removal{}}, Machine{Identity: "a", Node: "a0", Removal: &Removal{Etcd: EtcdPending}})
	if got := RevokedNodes(ms); !slices.Equal(got, []string{"a0", "w1"}) {
		t.Errorf("RevokedNodes = %v, want [a0 w1]", got)
	}
}

func TestReadAndDecode(t *testing.T) {
	ctx := context.Background()
	if _, err := Read(ctx, fake.NewClientset(), "berth-system"); !errors.Is(err, ErrNoRecord) {
		t.Fatalf("Read without a record = %v, want ErrNoRecord", err)
	}
	bad := fake.NewClientset(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: ConfigMapName, Namespace: "berth-system"}, Data: map[string]string{DataKey: "[{"}})
	if _, err := Read(ctx, bad, "berth-system"); err == nil {
		t.Fatal("Read of an unreadable record succeeded")
	}
	// Update never overwrites a record it cannot read.
	if _, err := Update(ctx, bad, "berth-system", func(ms []Machine) ([]Machine, error) { return nil, nil }); err == nil {
		t.Fatal("Update over an unreadable record succeeded")
	}
	if ms, err := Decode(" "); err != nil || ms != nil {
		t.Fatalf("Decode(blank) = %v, %v", ms, err)
	}
}

// TestUpdateOnAPIServer: concurrent writers (joinservice replicas and the CLI) never lose each
// other's changes, a change function's error ends the update without a write, and ErrUnchanged
// writes nothing.
func TestUpdateOnAPIServer(t *testing.T) {
	env := apiservertest.Shared(t)
	admin := env.Client(t, apiservertest.AdminUser)
	ctx := context.Background()
	const ns = "machines-update"
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	const writers, each = 4, 10
	var wg sync.WaitGroup
	errs := make(chan error, writers*each)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				m := Machine{Identity: fmt.Sprintf("%02d%02d", w, i), Node: fmt.Sprintf("n%d-%d", w, i), Role: RoleWorker, Admitted: at(i)}
				if _, err := Update(ctx, admin, ns, func(ms []Machine) ([]Machine, error) {
					ms, _ = Admit(ms, m)
					return ms, nil
				}); err != nil {
					errs <- err
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("Update: %v", err)
	}
	ms, err := Read(ctx, admin, ns)
	if err != nil || len(ms) != writers*each {
		t.Fatalf("record holds %d machines (%v), want %d", len(ms), err, writers*each)
	}
	cm, _ := admin.CoreV1().ConfigMaps(ns).Get(ctx, ConfigMapName, metav1.GetOptions{})
	boom := errors.New("boom")
	if _, err := Update(ctx, admin, ns, func([]Machine) ([]Machine, error) { return nil, boom }); !errors.Is(err, boom) {
		t.Fatalf("Update with a failing change = %v, want it", err)
	}
	got, err := Update(ctx, admin, ns, func([]Machine) ([]Machine, error) { return nil, ErrUnchanged })
	if err != nil || len(got) != writers*each {
		t.Fatalf("Update(ErrUnchanged) = %d machines, %v", len(got), err)
	}
	if after, _ := admin.CoreV1().ConfigMaps(ns).Get(ctx, ConfigMapName, metav1.GetOptions{}); after.ResourceVersion != cm.ResourceVersion {
		t.Error("a failed or unchanged Update wrote the record")
	}
	// A removal writes the API server's list with the record, in one write.
	if _, err := Update(ctx, admin, ns, func(ms []Machine) ([]Machine, error) {
		ms[Index(ms, "0100")].Removal = &Removal{}
		ms[Index(ms, "0001")].Removal = &Removal{}
		return ms, nil
	}); err != nil {
		t.Fatal(err)
	}
	after, err := admin.CoreV1().ConfigMaps(ns).Get(ctx, ConfigMapName, metav1.GetOptions{})
	if err != nil || after.Data[RevokedNodesKey] != "n0-1 n1-0" {
		t.Fatalf("%s = %q (%v), want \"n0-1 n1-0\"", RevokedNodesKey, after.Data[RevokedNodesKey], err)
	}
}
