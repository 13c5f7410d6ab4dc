package mini

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"

	"go.uber.org/zap/zaptest"

	"github.com/berth-k8s/berth/internal/metadata"
)

func TestNextNodes(t *testing.T) {
	cfg := testConfig("/x")
	cfg.TamperedWorkers = 1 // t1 at .13
	got := cfg.NextNodes(1, 2)
	want := []Node{
		{Name: "cp2", Role: metadata.RoleControlPlane, IP: netip.MustParseAddr("198.51.100.14")},
		{Name: "w3", Role: metadata.RoleWorker, IP: netip.MustParseAddr("198.51.100.15")},
		{Name: "w4", Role: metadata.RoleWorker, IP: netip.MustParseAddr("198.51.100.16")},
	}
	if len(got) != len(want) {
		t.Fatalf("NextNodes = %v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("node %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	// After they are added, the next ones follow them; the counted nodes keep their addresses.
	cfg.Added = got
	if next := cfg.NextNodes(0, 1); len(next) != 1 || next[0].Name != "w5" || next[0].IP != netip.MustParseAddr("198.51.100.17") {
		t.Errorf("NextNodes after add = %v", next)
	}
	if n, ok := cfg.Node("w1"); !ok || n.IP != netip.MustParseAddr("198.51.100.11") {
		t.Errorf("w1 moved: %v", n)
	}
	// A subnet that is full refuses more nodes.
	small := testConfig("/x")
	small.Subnet = netip.MustParsePrefix("198.51.100.0/26")
	small.Added = small.NextNodes(0, 51) // the last one would be .63, the broadcast address
	if err := small.Validate(); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Validate of 54 nodes in a /26 = %v, want ErrInvalidConfig", err)
	}
	small.Added = small.Added[:50]
	if err := small.Validate(); err != nil {
		t.Errorf("Validate of 53 nodes in a /26 = %v", err)
	}
}

func TestAddBuildsOnlyNewNodes(t *testing.T) {
	cl, rec, env := upTestCluster(t)
	cfg := cl.Config()
	// The agent (here: the test) lists the nodes it serves.
	if err := os.WriteFile(filepath.Join(cfg.Dir, agentNodesFile), []byte("cp1\nw1\nw2\nw3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	n := count(rec)
	killed := len(rec.killed)
	added, timings, err := cl.Add(context.Background(), AddOptions{Workers: 1, BerthArchive: "/tmp/berth-images/images-berth.tar"})
	if err != nil {
		t.Fatalf("Add: %v", err)
	}
	if len(added) != 1 || added[0].Name != "w3" || added[0].IP != netip.MustParseAddr("198.51.100.13") {
		t.Fatalf("added %v", added)
	}
	if len(timings.Phases) != 10 {
		t.Errorf("phases = %v", timings.Phases)
	}
	cmds := since(rec, n)
	for _, want := range []string{
		"ip netns add berth-t-w3",
		"ip -n berth-t-w3 addr add 198.51.100.13/24 dev eth0",
		"unshare --mount=" + cfg.MountNS("w3"),
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/lib/etcd",
		"swtpm_setup --tpm2 --tpmstate " + filepath.Join(cfg.NodeDir("w3"), "tpm"),
		"start nsenter --net=" + filepath.Join(env.NetnsRoot, "berth-t-w3") + " -- swtpm socket",
		pcrExtend(false),
		"images import /tmp/berth-images/images-berth.tar",
		"start nsenter --net=" + filepath.Join(env.NetnsRoot, "berth-t-w3") + " --mount=" + cfg.MountNS("w3") + " --uts=" + cfg.UTSNS("w3") + " -- /bin/bootstrapper",
		"start nsenter --net=" + filepath.Join(env.NetnsRoot, "berth-t-w3") + " --mount=" + cfg.MountNS("w3") + " --uts=" + cfg.UTSNS("w3") + " -- " + filepath.Join(cfg.NodeDir("w3"), "bin", "containerd"),
	} {
		if !strings.Contains(cmds, want) {
			t.Errorf("add lacks %q:\n%s", want, cmds)
		}
	}
	for _, other := range []string{"berth-t-cp1", "berth-t-w1", "berth-t-w2", "berth-t-sw link add br0", "mini agent"} {
		if strings.Contains(cmds, other) {
			t.Errorf("add touched %s:\n%s", other, cmds)
		}
	}
	if len(rec.killed) != killed {
		t.Error("add killed processes")
	}
	if fi, err := os.Stat(cfg.StateDisk("w3")); err != nil || fi.Size() != DefaultStateDiskSize {
		t.Errorf("state disk of w3: %v", err)
	}
	// Recorded: a reopened cluster knows w3 (so the agent serves it and Down removes it), and the
	// running nodes' /etc/hosts name it.
	cl2, err := Open(cfg.Dir, env, rec, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if n, ok := cl2.Config().Node("w3"); !ok || n.Role != metadata.RoleWorker {
		t.Errorf("w3 not recorded: %+v", cl2.Config())
	}
	if st, _ := LoadState(cfg.Dir); len(st.Procs["w3"]) != 3 {
		t.Errorf("w3's daemons not recorded: %v", st.Procs["w3"])
	}
	hosts, err := os.ReadFile(filepath.Join(cfg.NodeDir("cp1"), "fs", "hosts"))
	if err != nil || !strings.Contains(string(hosts), "198.51.100.13\tw3\n") {
		t.Errorf("cp1's hosts file lacks w3: %q %v", hosts, err)
	}
	// Down removes the added node too.
	n = count(rec)
	cl2.rmdir = os.RemoveAll
	if _, err := cl2.Down(context.Background()); err != nil {
		t.Fatalf("Down: %v", err)
	}
	if cmds := since(rec, n); !strings.Contains(cmds, "ip netns delete berth-t-w3") || !strings.Contains(cmds, "losetup -j "+cfg.StateDisk("w3")) {
		t.Errorf("Down did not remove w3:\n%s", cmds)
	}
}

func TestAddRefusals(t *testing.T) {
	cl, rec, _ := upTestCluster(t)
	n := count(rec)
	if _, _, err := cl.Add(context.Background(), AddOptions{}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Add of nothing = %v, want ErrInvalidConfig", err)
	}
	if _, _, err := cl.Add(context.Background(), AddOptions{Workers: 300}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Add beyond the subnet = %v, want ErrInvalidConfig", err)
	}
	st, _ := LoadState(cl.Config().Dir)
	if err := rec.Signal(*st.Agent, 9); err != nil {
		t.Fatal(err)
	}
	if _, _, err := cl.Add(context.Background(), AddOptions{Workers: 1}); !errors.Is(err, ErrNoAgent) {
		t.Errorf("Add without an agent = %v, want ErrNoAgent", err)
	}
	if got := since(rec, n); got != "" {
		t.Errorf("a refused add ran commands:\n%s", got)
	}
	if _, ok := cl.Config().Node("w3"); ok {
		t.Error("a refused add recorded a node")
	}
}

// A node the agent does not serve gets no bootstrapper: it could not learn who it is.
func TestAddWaitsForTheAgent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cl, rec, _ := upTestCluster(t)
		_, _, err := cl.Add(context.Background(), AddOptions{Workers: 1})
		if err == nil || !strings.Contains(err.Error(), "waiting for the agent to serve w3") {
			t.Fatalf("Add with an agent that never serves w3 = %v", err)
		}
		if strings.Contains(rec.all(), cl.Config().MountNS("w3")+" --uts="+cl.Config().UTSNS("w3")+" -- /bin/bootstrapper") {
			t.Error("w3's bootstrapper started before the agent served it")
		}
	})
}
