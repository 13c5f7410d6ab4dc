package mini

import (
	"context"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap/zaptest"
)

// upTestCluster brings up a cluster on a recording runner and returns it with the runner.
func upTestCluster(t *testing.T) (*Cluster, *recorder, Env) {
	t.Helper()
	env := fakeEnv(t)
	cfg := testConfig(filepath.Join(t.TempDir(), "cluster"))
	cfg.Bootstrapper = "/bin/bootstrapper"
	rec := &recorder{cgroupRoot: env.CgroupRoot, respond: fakeNetns(env)}
	cl := New(cfg, env, rec, zaptest.NewLogger(t))
	cl.dialer = func(context.Context, string) error { return nil }
	cl.rmdir = os.RemoveAll // the fake cgroupfs holds real files
	if _, err := cl.Up(context.Background(), UpOptions{InitSecret: []byte("s")}); err != nil {
		t.Fatalf("Up: %v", err)
	}
	t.Cleanup(func() {
		if _, err := cl.Down(context.Background()); err != nil {
			t.Errorf("Down: %v", err)
		}
	})
	return cl, rec, env
}

// fakeNetns answers `ip netns add|delete NAME` by creating or removing the pin file, as ip does.
func fakeNetns(env Env) func(Cmd) ([]byte, error) {
	return func(cmd Cmd) ([]byte, error) {
		if cmd.Path != "ip" || len(cmd.Args) != 3 || cmd.Args[0] != "netns" {
			return nil, nil
		}
		pin := filepath.Join(env.NetnsRoot, cmd.Args[2])
		switch cmd.Args[1] {
		case "add":
			return nil, writeFile(pin, nil, 0o644)
		case "delete":
			return nil, os.Remove(pin)
		}
		return nil, nil
	}
}

// since returns the commands rec ran after the first n.
func since(rec *recorder, n int) string {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return strings.Join(rec.cmds[n:], "\n")
}

func count(rec *recorder) int {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return len(rec.cmds)
}

func pcrExtend(tampered bool) string {
	ev := bootEvent(tampered)
	return "tpm2_pcrextend -T swtpm:host=127.0.0.1,port=2321 4:sha256=" + hex.EncodeToString(ev[:])
}

// upW1 starts the test cluster and writes a state disk for w1. It returns the disk image and the
// processes of the other nodes (cp1, w2), which an operation on w1 alone must leave running.
func upW1(t *testing.T) (cl *Cluster, rec *recorder, env Env, others []Proc, img string) {
	t.Helper()
	cl, rec, env = upTestCluster(t)
	st, err := LoadState(cl.Config().Dir)
	if err != nil {
		t.Fatal(err)
	}
	others = append(append([]Proc(nil), st.Procs["cp1"]...), st.Procs["w2"]...)
	img = cl.Config().StateDisk("w1")
	if err := os.WriteFile(img, []byte("the node's disk"), 0o600); err != nil {
		t.Fatal(err)
	}
	return cl, rec, env, others, img
}

// checkW1Only checks that op on w1 killed its 3 daemons and nothing else (killed is len(rec.killed)
// before op), and that w1's state disk upW1 wrote survived.
func checkW1Only(t *testing.T, op string, rec *recorder, killed int, others []Proc, img string) {
	t.Helper()
	if got := len(rec.killed) - killed; got != 3 {
		t.Errorf("%s of w1 killed %d processes, want its 3 daemons", op, got)
	}
	for _, p := range others {
		if !rec.Alive(p) {
			t.Errorf("process %d of another node was killed", p.PID)
		}
	}
	if b, err := os.ReadFile(img); err != nil || string(b) != "the node's disk" {
		t.Errorf("state disk after %s = %q, %v", op, b, err)
	}
}

func TestRestartNamedNodeOnly(t *testing.T) {
	cl, rec, env, others, img := upW1(t)
	cfg := cl.Config()
	n := count(rec)
	killed := len(rec.killed)
	if _, err := cl.Restart(context.Background(), RestartOptions{Nodes: []string{"w1"}}); err != nil {
		t.Fatalf("Restart(w1): %v", err)
	}
	cmds := since(rec, n)
	// w1 is power-cycled: killed, its namespaces gone and rebuilt, its disk's loop devices checked.
	for _, want := range []string{
		"ip -n berth-t-sw link delete w1",
		"ip netns delete berth-t-w1",
		"ip netns add berth-t-w1",
		"unshare --mount=" + cfg.MountNS("w1"),
		"losetup -j " + img,
		"start nsenter --net=" + filepath.Join(env.NetnsRoot, "berth-t-w1") + " -- swtpm socket",
		pcrExtend(false),
		"-- /bin/bootstrapper",
	} {
		if !strings.Contains(cmds, want) {
			t.Errorf("restart of w1 lacks %q:\n%s", want, cmds)
		}
	}
	// The other nodes keep running: none of their processes died, nothing of theirs was touched; the
	// disk survives the power cycle: a machine keeps its disk.
	checkW1Only(t, "restart", rec, killed, others, img)
	for _, other := range []string{"berth-t-cp1", "berth-t-w2", "cp1.mnt", "w2.mnt", cfg.StateDisk("w2")} {
		if strings.Contains(cmds, other) {
			t.Errorf("restart of w1 touched %s:\n%s", other, cmds)
		}
	}
	st, err := LoadState(cfg.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Procs["w1"]) != 3 || len(st.Procs["cp1"]) != 3 {
		t.Errorf("recorded daemons after restart: %v", st.Procs)
	}
}

func TestRestartTamperBootPersistsAndClearTPM(t *testing.T) {
	cl, rec, _ := upTestCluster(t)
	cfg := cl.Config()
	n := count(rec)
	if _, err := cl.Restart(context.Background(), RestartOptions{Nodes: []string{"w2", "cp1"}, TamperBoot: []string{"w2"}, ClearTPM: []string{"cp1"}}); err != nil {
		t.Fatalf("Restart: %v", err)
	}
	cmds := since(rec, n)
	if !strings.Contains(cmds, pcrExtend(true)) {
		t.Errorf("w2's boot was not measured as tampered:\n%s", cmds)
	}
	// cp1's TPM is cleared in its own network namespace, after swtpm started, before its boot is measured.
	lines := strings.Split(cmds, "\n")
	idx := func(pred func(string) bool) int {
		for i, l := range lines {
			if pred(l) {
				return i
			}
		}
		return -1
	}
	cp1Net := "--net=" + filepath.Join(cl.env.NetnsRoot, "berth-t-cp1")
	swtpm := idx(func(l string) bool { return strings.Contains(l, cp1Net) && strings.Contains(l, "swtpm socket") })
	clear := idx(func(l string) bool {
		return strings.Contains(l, cp1Net+" -- tpm2_clear -T swtpm:host=127.0.0.1,port=2321")
	})
	measure := idx(func(l string) bool { return strings.Contains(l, cp1Net) && strings.Contains(l, pcrExtend(false)) })
	if swtpm < 0 || clear < 0 || measure < 0 || swtpm >= clear || clear >= measure {
		t.Errorf("want swtpm start < tpm2_clear < pcrextend for cp1, got %d %d %d:\n%s", swtpm, clear, measure, cmds)
	}
	if strings.Count(cmds, "tpm2_clear") != 1 {
		t.Errorf("tpm2_clear ran for a node not asked for:\n%s", cmds)
	}
	// The tampered boot is recorded: the next restart (of all nodes) measures w2 tampered again,
	// clears no TPM, and w2 is not among the nodes to wait for.
	if st, err := LoadState(cfg.Dir); err != nil || !st.Config.BootTampered["w2"] {
		t.Fatalf("tampered boot not in the state file: %+v, %v", st, err)
	}
	cl2, err := Open(cfg.Dir, cl.env, rec, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	cl2.rmdir = os.RemoveAll
	for _, g := range cl2.Config().GenuineNodes() {
		if g.Name == "w2" {
			t.Error("a tampered-boot node is counted as genuine")
		}
	}
	n = count(rec)
	if _, err := cl2.Restart(context.Background(), RestartOptions{}); err != nil {
		t.Fatalf("Restart all: %v", err)
	}
	cmds = since(rec, n)
	if strings.Count(cmds, pcrExtend(true)) != 1 || strings.Count(cmds, pcrExtend(false)) != 2 || strings.Contains(cmds, "tpm2_clear") {
		t.Errorf("second restart: want w2 tampered, cp1 and w1 genuine, no clear:\n%s", cmds)
	}
	// --genuine-boot undoes it.
	n = count(rec)
	if _, err := cl2.Restart(context.Background(), RestartOptions{Nodes: []string{"w2"}, GenuineBoot: []string{"w2"}}); err != nil {
		t.Fatalf("Restart genuine: %v", err)
	}
	if cmds = since(rec, n); !strings.Contains(cmds, pcrExtend(false)) || strings.Contains(cmds, pcrExtend(true)) {
		t.Errorf("genuine boot of w2 not measured as genuine:\n%s", cmds)
	}
	if st, _ := LoadState(cfg.Dir); st.Config.BootTampered["w2"] {
		t.Error("genuine boot not recorded")
	}
}

func TestRestartRejectsBadNames(t *testing.T) {
	cl, rec, _ := upTestCluster(t)
	n := count(rec)
	for name, opts := range map[string]RestartOptions{
		"unknown node":            {Nodes: []string{"w9"}},
		"unknown tamper node":     {TamperBoot: []string{"w9"}},
		"tamper a running node":   {Nodes: []string{"w1"}, TamperBoot: []string{"w2"}},
		"clear a running node":    {Nodes: []string{"w1"}, ClearTPM: []string{"cp1"}},
		"genuine a running node":  {Nodes: []string{"w1"}, GenuineBoot: []string{"w2"}},
		"both tampered & genuine": {TamperBoot: []string{"w1"}, GenuineBoot: []string{"w1"}},
	} {
		_, err := cl.Restart(context.Background(), opts)
		if err == nil {
			t.Errorf("%s: Restart succeeded", name)
		}
		if strings.Contains(name, "unknown") && !errors.Is(err, ErrUnknownNode) {
			t.Errorf("%s: %v, want ErrUnknownNode", name, err)
		}
		if strings.Contains(name, "running") && !errors.Is(err, ErrNotRestarted) {
			t.Errorf("%s: %v, want ErrNotRestarted", name, err)
		}
	}
	if got := since(rec, n); got != "" {
		t.Errorf("a refused restart ran commands:\n%s", got)
	}
}

// TestRestartBootstrappers: only the named node's bootstrapper is killed and started again; its
// swtpm and containerd, and every other node, keep running and nothing is rebuilt.
func TestRestartBootstrappers(t *testing.T) {
	cl, rec, _ := upTestCluster(t)
	cfg := cl.Config()
	st, err := LoadState(cfg.Dir)
	if err != nil {
		t.Fatal(err)
	}
	var old Proc
	var kept []Proc
	for _, p := range st.Procs["cp1"] {
		if p.Name == "bootstrapper" {
			old = p
		} else {
			kept = append(kept, p)
		}
	}
	kept = append(kept, st.Procs["w1"]...)
	n := count(rec)
	if err := cl.RestartBootstrappers(context.Background(), []string{"cp1"}); err != nil {
		t.Fatalf("RestartBootstrappers(cp1): %v", err)
	}
	if rec.Alive(old) {
		t.Error("the old bootstrapper still runs")
	}
	for _, p := range kept {
		if !rec.Alive(p) {
			t.Errorf("%s (pid %d) was killed", p.Name, p.PID)
		}
	}
	cmds := since(rec, n)
	if strings.Count(cmds, "\n")+1 != 1 || !strings.Contains(cmds, "start nsenter") || !strings.HasSuffix(cmds, "-- /bin/bootstrapper") {
		t.Errorf("commands of the restart: want only the new bootstrapper's start:\n%s", cmds)
	}
	st, err = LoadState(cfg.Dir)
	if err != nil {
		t.Fatal(err)
	}
	bootstrappers := 0
	for _, p := range st.Procs["cp1"] {
		if p.Name == "bootstrapper" {
			bootstrappers++
			if p.PID == old.PID {
				t.Error("the state file still records the killed bootstrapper")
			}
		}
	}
	if bootstrappers != 1 || len(st.Procs["cp1"]) != 3 {
		t.Errorf("recorded daemons of cp1 after the restart: %+v", st.Procs["cp1"])
	}
	if err := cl.RestartBootstrappers(context.Background(), []string{"nope"}); !errors.Is(err, ErrUnknownNode) {
		t.Errorf("RestartBootstrappers(nope) = %v, want ErrUnknownNode", err)
	}
}
