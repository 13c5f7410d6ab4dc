package mini

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestStopLeavesNodeOff: stop powers a node off (its daemons killed, its namespaces and loop device
// gone, its disk kept) and records it; a restart of every node leaves it off and no wait counts
// it; restart NODE powers it on again.
func TestStopLeavesNodeOff(t *testing.T) {
	cl, rec, env, others, img := upW1(t)
	cfg := cl.Config()
	n, killed := count(rec), len(rec.killed)
	if _, err := cl.Stop(context.Background(), []string{"w1"}, nil); err != nil {
		t.Fatalf("Stop(w1): %v", err)
	}
	cmds := since(rec, n)
	for _, want := range []string{"ip -n berth-t-sw link delete w1", "ip netns delete berth-t-w1", "losetup -j " + img} {
		if !strings.Contains(cmds, want) {
			t.Errorf("stop of w1 lacks %q:\n%s", want, cmds)
		}
	}
	for _, notWant := range []string{"ip netns add", "swtpm", "/bin/bootstrapper", "berth-t-cp1", "berth-t-w2"} {
		if strings.Contains(cmds, notWant) {
			t.Errorf("stop of w1 ran %q:\n%s", notWant, cmds)
		}
	}
	checkW1Only(t, "stop", rec, killed, others, img)
	if _, err := os.Stat(filepath.Join(env.NetnsRoot, "berth-t-w1")); err == nil {
		t.Error("w1's network namespace is still there")
	}

	// Recorded: a reopened cluster knows w1 is off.
	cl2, err := Open(cfg.Dir, cl.env, rec, cl.log)
	if err != nil {
		t.Fatal(err)
	}
	cl2.rmdir = os.RemoveAll
	if w1, _ := cl2.Config().Node("w1"); !w1.Stopped {
		t.Fatal("w1 not recorded as stopped")
	}
	for _, g := range cl2.Config().GenuineNodes() {
		if g.Name == "w1" {
			t.Error("a stopped node is among the nodes to wait for")
		}
	}
	n = count(rec)
	if _, err := cl2.Restart(context.Background(), RestartOptions{}); err != nil {
		t.Fatalf("Restart all: %v", err)
	}
	if cmds := since(rec, n); strings.Contains(cmds, "berth-t-w1") || !strings.Contains(cmds, "berth-t-w2") {
		t.Errorf("restart of every node: want w1 left off and w2 restarted:\n%s", cmds)
	}

	// restart w1 powers it on and forgets that it was stopped.
	n = count(rec)
	if _, err := cl2.Restart(context.Background(), RestartOptions{Nodes: []string{"w1"}}); err != nil {
		t.Fatalf("Restart(w1): %v", err)
	}
	if cmds := since(rec, n); !strings.Contains(cmds, "ip netns add berth-t-w1") || !strings.Contains(cmds, "-- /bin/bootstrapper") {
		t.Errorf("restart of the stopped w1 did not boot it:\n%s", cmds)
	}
	if st, _ := LoadState(cfg.Dir); st.Config.Stopped["w1"] {
		t.Error("w1 still recorded as stopped after it was powered on")
	}
}

func TestStopRefusesBadNames(t *testing.T) {
	cl, rec, _ := upTestCluster(t)
	n := count(rec)
	if _, err := cl.Stop(context.Background(), nil, nil); !errors.Is(err, ErrNoNodes) {
		t.Errorf("Stop() without names = %v, want ErrNoNodes", err)
	}
	if _, err := cl.Stop(context.Background(), []string{"w9"}, nil); !errors.Is(err, ErrUnknownNode) {
		t.Errorf("Stop(w9) = %v, want ErrUnknownNode", err)
	}
	if got := since(rec, n); got != "" {
		t.Errorf("a refused stop ran commands:\n%s", got)
	}
}

// TestRestartWipeDisk: a reinstalled node gets a blank state disk (the old one's bytes are gone),
// keeps its TPM, and another node's disk is untouched.
func TestRestartWipeDisk(t *testing.T) {
	cl, rec, _ := upTestCluster(t)
	cfg := cl.Config()
	cni := func(n string) string { return filepath.Join(cfg.NodeDir(n), "fs", "etc-cni-net.d", cniConfName) }
	for _, n := range []string{"w1", "w2"} {
		if err := os.WriteFile(cfg.StateDisk(n), []byte("the node's disk"), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{cni(n)} {
			if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(f, []byte("10.244.1.0/24"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := cl.Restart(context.Background(), RestartOptions{Nodes: []string{"w2"}, WipeDisk: []string{"w1"}}); !errors.Is(err, ErrNotRestarted) {
		t.Fatalf("wiping a node that is not restarted = %v, want ErrNotRestarted", err)
	}
	n := count(rec)
	if _, err := cl.Restart(context.Background(), RestartOptions{Nodes: []string{"w1"}, WipeDisk: []string{"w1"}}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(cfg.StateDisk("w1"))
	if err != nil || st.Size() != cfg.StateDiskBytes() {
		t.Fatalf("w1's disk after the wipe: %v, %v", st, err)
	}
	// The disk is sparse and large: read only where the old content was.
	if b := readHead(t, cfg.StateDisk("w1"), 64); strings.Contains(string(b), "the node's disk") {
		t.Fatal("w1's old disk content survived the wipe")
	}
	if b, _ := os.ReadFile(cfg.StateDisk("w2")); string(b) != "the node's disk" {
		t.Fatal("w2's disk changed")
	}
	// Its pod network configuration went with it (its next Node may get another pod range; its
	// address leases were on the state disk); w2's stays.
	if _, err := os.Stat(cni("w1")); err == nil {
		t.Errorf("%s survived the reinstall", cni("w1"))
	}
	for _, f := range []string{cni("w2")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("w2's %s: %v", f, err)
		}
	}
	if cmds := since(rec, n); strings.Contains(cmds, "tpm2_clear") {
		t.Errorf("the wipe touched w1's TPM:\n%s", cmds)
	}
}

// readHead returns the first n bytes of the file at path (fewer if it is shorter).
func readHead(t *testing.T, path string, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = f.Close() }()
	b := make([]byte, n)
	m, err := io.ReadFull(f, b)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	return b[:m]
}
