package mini

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/mini/image"
	"github.com/berth-k8s/berth/internal/prereq"
)

// agentEnvVar makes the test binary act as the cluster's agent (`berth mini agent`), so the
// integration test needs no berth binary.
const agentEnvVar = "BERTH_MINI_TEST_AGENT"

func TestMain(m *testing.M) {
	if os.Getenv(agentEnvVar) == "1" {
		os.Exit(runTestAgent())
	}
	goleak.VerifyTestMain(m)
}

func runTestAgent() int {
	dir := ""
	for i, a := range os.Args {
		if a == "--dir" && i+1 < len(os.Args) {
			dir = os.Args[i+1]
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	log, _ := zap.NewDevelopment()
	if err := RunAgent(ctx, dir, log); err != nil {
		log.Error("agent failed", zap.Error(err))
		return 1
	}
	return 0
}

// requireIntegration skips unless the host can run namespace nodes; under CI=true a missing
// prerequisite fails the test instead.
func requireIntegration(t *testing.T) {
	t.Helper()
	skip := func(format string, args ...any) { prereq.Missing(t, format, args...) }
	if os.Geteuid() != 0 {
		skip("needs root (network namespaces, mounts, cgroups)")
	}
	for _, bin := range []string{"ip", "nsenter", "unshare", "losetup", "containerd", "ctr", "runc", "swtpm", "swtpm_setup",
		"tpm2_pcrextend", "tpm2_clear", "tpm2_createprimary", "tpm2_evictcontrol", "tpm2_getcap", "tpm2_pcrread", "go"} {
		if _, err := exec.LookPath(bin); err != nil {
			skip("needs %s (scripts/install-deps.sh installs it)", bin)
		}
	}
	if _, err := os.Stat("/sys/fs/cgroup/memory/cgroup.procs"); err != nil { // kubelet needs v1 here
		skip("needs cgroup v1 hierarchies under /sys/fs/cgroup")
	}
}

// buildPodBins builds build/podbin's pause and testapp into a temporary directory.
func buildPodBins(t *testing.T) string {
	t.Helper()
	out := t.TempDir()
	cmd := exec.Command("go", "build", "-trimpath", "-o", out+"/", "./pause", "./testapp")
	cmd.Dir = filepath.Join("..", "..", "build", "podbin")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building pod binaries: %v\n%s", err, b)
	}
	return out
}

// TestIntegrationTwoNodes creates two nodes with containerd and swtpm, runs the test image in one,
// reaches it from the other across the switch, removes everything and checks for residue.
func TestIntegrationTwoNodes(t *testing.T) {
	requireIntegration(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// Concurrent runs (two go test invocations on one host) would share names and addresses.
	lock, err := os.OpenFile(filepath.Join(os.TempDir(), "berth-mini-itest.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}

	podbin := buildPodBins(t)
	archive := filepath.Join(t.TempDir(), "images.tar")
	if err := image.WriteArchive(archive, []image.Spec{
		{Tag: k8sversion.Default().Images().Pause, Files: []image.File{{Src: filepath.Join(podbin, "pause"), Dst: "/pause"}}, Entrypoint: []string{"/pause"}},
		{Tag: ImageTestApp, Files: []image.File{{Src: filepath.Join(podbin, "testapp"), Dst: "/testapp"}}, Entrypoint: []string{"/testapp"}},
	}); err != nil {
		t.Fatal(err)
	}

	env, err := HostEnv()
	if err != nil {
		t.Fatal(err)
	}
	env.Self = os.Args[0]
	env.AgentEnv = []string{agentEnvVar + "=1"}
	cfg := Config{
		Name: "itest", Dir: filepath.Join(t.TempDir(), "cluster"),
		// Disjoint from berth mini's default and from the e2e tests' subnets. Not 203.0.113.0/25: a
		// host route into it would shadow the Go module proxy's address on the project's machines.
		Subnet:        netip.MustParsePrefix("203.0.113.192/26"),
		PodCIDR:       netip.MustParsePrefix(DefaultPodCIDR),
		ServiceCIDR:   netip.MustParsePrefix(DefaultServiceCIDR),
		ControlPlanes: 1, Workers: 1,
		Bins:         Bins{K8s: "/nonexistent"},
		ImageArchive: archive,
	}
	log := zaptest.NewLogger(t)
	cl := New(cfg, env, Exec{}, log)
	down := func() {
		t.Helper()
		if _, err := cl.Down(context.Background()); err != nil {
			t.Errorf("down: %v", err)
		}
	}
	defer func() {
		var procs []Proc
		if st, err := LoadState(cfg.Dir); err == nil {
			if st.Agent != nil {
				procs = append(procs, *st.Agent)
			}
			for _, ps := range st.Procs {
				procs = append(procs, ps...)
			}
		}
		down()
		checkNoResidue(t, cfg, env)
		for _, p := range procs {
			if (Exec{}).Alive(p) {
				t.Errorf("%s (pid %d) still runs after down", p.Name, p.PID)
			}
		}
	}()

	timings, err := cl.Up(ctx, UpOptions{InitSecret: []byte("secret")})
	for _, p := range timings.Phases {
		t.Logf("up phase %-14s %v", p.Name, p.Duration.Round(time.Millisecond))
	}
	if err != nil {
		logs(t, cfg)
		t.Fatalf("up: %v", err)
	}
	nodes := cfg.Nodes()
	run := func(args ...string) string {
		t.Helper()
		out, err := Exec{}.Run(ctx, Cmd{Path: args[0], Args: args[1:]})
		if err != nil {
			logs(t, cfg)
			t.Fatalf("%v", err)
		}
		return string(out)
	}
	// The test image runs in a container of node 1 (cgroup inside the node's subtree).
	out := run(append(append([]string{"nsenter"}, cl.nsenter(nodes[0].Name)...), "ctr", "--address", "/run/containerd/containerd.sock",
		"-n", "k8s.io", "run", "--rm", "--cgroup", cfg.CgroupPath(nodes[0].Name)+"/smoke", ImageTestApp, "smoke", "/testapp", "hello")...)
	if !strings.Contains(out, "hello from container") {
		t.Fatalf("container output %q lacks the greeting", out)
	}
	// A server in node 2's network (host network of the node) is reachable from node 1 over the switch.
	run(append(append([]string{"nsenter"}, cl.nsenter(nodes[1].Name)...), "ctr", "--address", "/run/containerd/containerd.sock",
		"-n", "k8s.io", "run", "-d", "--net-host", "--cgroup", cfg.CgroupPath(nodes[1].Name)+"/serve", ImageTestApp, "serve", "/testapp", "serve")...)
	url := "http://" + netip.AddrPortFrom(nodes[1].IP, 8080).String() + "/"
	var got string
	_ = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		o, err := Exec{}.Run(ctx, Cmd{Path: "nsenter", Args: []string{"--net=" + filepath.Join(env.NetnsRoot, cfg.NodeNetns(nodes[0].Name)), "--",
			filepath.Join(podbin, "testapp"), "get", url}})
		if err != nil {
			return false, nil
		}
		got = string(o)
		return true, nil
	})
	if !strings.Contains(got, "testapp on "+nodes[1].Name) {
		t.Fatalf("GET %s from %s = %q, want the answer of %s", url, nodes[0].Name, got, nodes[1].Name)
	}
	// The metadata API answers a node by its source address.
	o := run("nsenter", "--net="+filepath.Join(env.NetnsRoot, cfg.NodeNetns(nodes[1].Name)), "--",
		filepath.Join(podbin, "testapp"), "get", cfg.MetadataURL()+"/v1/self")
	if !strings.Contains(o, `"name":"`+nodes[1].Name+`"`) {
		t.Fatalf("metadata /v1/self for %s = %q", nodes[1].Name, o)
	}
	// No namespace has a default route.
	for _, ns := range []string{cfg.SwitchNetns(), cfg.NodeNetns(nodes[0].Name), cfg.NodeNetns(nodes[1].Name)} {
		if out := run("ip", "-n", ns, "route", "show", "default"); strings.TrimSpace(out) != "" {
			t.Errorf("namespace %s has a default route: %s", ns, out)
		}
	}
	// Each node's swtpm holds an EK certificate issued by the cluster's CA.
	for _, n := range nodes {
		if _, err := os.Stat(filepath.Join(cfg.NodeDir(n.Name), "ek", "ek-secp384r1.crt")); err != nil {
			t.Errorf("node %s has no ECC EK certificate: %v", n.Name, err)
		}
	}

	// Until a bootstrapper binds the state disk, the node's state directories refuse writes.
	for _, d := range []string{"/etc/kubernetes", "/var/lib/kubelet", "/var/lib/etcd", NodeStateDir} {
		if out, err := (Exec{}).Run(ctx, Cmd{Path: "nsenter", Args: append(cl.nsenter(nodes[1].Name), "touch", d+"/unencrypted")}); err == nil {
			t.Errorf("writing into %s of a node without its state disk succeeded: %s", d, out)
		}
	}
	// A loop device left on a node's state disk (one without autoclear, as after a crash) is
	// detached by the power-off before the node boots again.
	img := cfg.StateDisk(nodes[1].Name)
	dev := strings.TrimSpace(run("losetup", "-f", "--show", img))
	t.Cleanup(func() {
		if out, _ := (Exec{}).Run(context.Background(), Cmd{Path: "losetup", Args: []string{"-j", img}}); strings.Contains(string(out), dev+":") {
			_, _ = Exec{}.Run(context.Background(), Cmd{Path: "losetup", Args: []string{"-d", dev}})
		}
	})

	// An object under the owner hierarchy of node 1's TPM (as a sealed disk key is) survives a
	// plain restart and dies when the TPM is cleared; the EK certificate survives both.
	tpm := func(args ...string) string {
		t.Helper()
		return run(append([]string{"nsenter", "--net=" + filepath.Join(env.NetnsRoot, cfg.NodeNetns(nodes[0].Name)), "--",
			args[0], "-T", fmt.Sprintf("swtpm:host=127.0.0.1,port=%d", TPMPort)}, args[1:]...)...)
	}
	const persistent = "0x81000010"
	primary := filepath.Join(t.TempDir(), "primary.ctx")
	tpm("tpm2_createprimary", "-C", "o", "-c", primary)
	tpm("tpm2_evictcontrol", "-C", "o", "-c", primary, persistent)

	rt, err := cl.Restart(ctx, RestartOptions{})
	for _, p := range rt.Phases {
		t.Logf("restart phase %-14s %v", p.Name, p.Duration.Round(time.Millisecond))
	}
	if err != nil {
		logs(t, cfg)
		t.Fatalf("restart: %v", err)
	}
	out = run(append(append([]string{"nsenter"}, cl.nsenter(nodes[1].Name)...), "ctr", "--address", "/run/containerd/containerd.sock",
		"-n", "k8s.io", "images", "ls", "-q")...)
	if !strings.Contains(out, ImageTestApp) {
		t.Fatalf("images after restart: %q lacks %s", out, ImageTestApp)
	}
	if out := run("losetup", "-j", img); strings.TrimSpace(out) != "" {
		t.Errorf("state disk still attached after the restart: %s", out)
	}
	if out := tpm("tpm2_getcap", "handles-persistent"); !strings.Contains(out, persistent) {
		t.Fatalf("persistent TPM object gone after a plain restart: %q", out)
	}
	// Node 1 alone: its TPM cleared, its boot tampered; node 2 keeps running.
	st, err := LoadState(cfg.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Restart(ctx, RestartOptions{Nodes: []string{nodes[0].Name}, ClearTPM: []string{nodes[0].Name}, TamperBoot: []string{nodes[0].Name}}); err != nil {
		logs(t, cfg)
		t.Fatalf("restart of %s: %v", nodes[0].Name, err)
	}
	for _, p := range st.Procs[nodes[1].Name] {
		if !(Exec{}).Alive(p) {
			t.Errorf("%s of %s died in the restart of %s", p.Name, nodes[1].Name, nodes[0].Name)
		}
	}
	if out := tpm("tpm2_getcap", "handles-persistent"); strings.Contains(out, persistent) {
		t.Errorf("persistent TPM object survived the TPM clear: %q", out)
	}
	if out := tpm("tpm2_getcap", "handles-nv-index"); !strings.Contains(strings.ToLower(out), "0x1c00002") {
		t.Errorf("EK certificate NV index gone after the TPM clear: %q", out)
	}
	tampered := bootEvent(true)
	var zero [32]byte
	want := sha256.Sum256(append(zero[:], tampered[:]...))
	if out := tpm("tpm2_pcrread", fmt.Sprintf("sha256:%d", BootPCR)); !strings.Contains(strings.ToLower(out), hex.EncodeToString(want[:])) {
		t.Errorf("PCR %d after a tampered boot: %q, want %x", BootPCR, out, want)
	}

	// A node added to the running cluster is served by the running agent and reaches the others.
	added, at, err := cl.Add(ctx, AddOptions{Workers: 1})
	for _, p := range at.Phases {
		t.Logf("add phase %-14s %v", p.Name, p.Duration.Round(time.Millisecond))
	}
	if err != nil {
		logs(t, cfg)
		t.Fatalf("add: %v", err)
	}
	cfg = cl.Config() // Down and checkNoResidue must know the added node
	o = run("nsenter", "--net="+filepath.Join(env.NetnsRoot, cfg.NodeNetns(added[0].Name)), "--",
		filepath.Join(podbin, "testapp"), "get", cfg.MetadataURL()+"/v1/self")
	if !strings.Contains(o, `"name":"`+added[0].Name+`"`) {
		t.Fatalf("metadata /v1/self for the added %s = %q", added[0].Name, o)
	}
	// The power cut killed node 2's server: start it again, then reach it from the added node.
	run(append(append([]string{"nsenter"}, cl.nsenter(nodes[1].Name)...), "ctr", "--address", "/run/containerd/containerd.sock",
		"-n", "k8s.io", "run", "-d", "--net-host", "--cgroup", cfg.CgroupPath(nodes[1].Name)+"/serve2", ImageTestApp, "serve2", "/testapp", "serve")...)
	got = ""
	_ = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 20*time.Second, true, func(ctx context.Context) (bool, error) {
		o, err := Exec{}.Run(ctx, Cmd{Path: "nsenter", Args: []string{"--net=" + filepath.Join(env.NetnsRoot, cfg.NodeNetns(added[0].Name)), "--",
			filepath.Join(podbin, "testapp"), "get", url}})
		got = string(o)
		return err == nil, nil
	})
	if !strings.Contains(got, "testapp on "+nodes[1].Name) {
		t.Errorf("GET %s from the added node = %q", url, got)
	}
}

func logs(t *testing.T, cfg Config) {
	t.Helper()
	files, _ := filepath.Glob(filepath.Join(cfg.Dir, "nodes", "*", "logs", "*.log"))
	files = append(files, filepath.Join(cfg.Dir, "agent.log"))
	for _, f := range files {
		b, _ := os.ReadFile(f)
		if len(b) > 3000 {
			b = b[len(b)-3000:]
		}
		t.Logf("--- %s\n%s", f, b)
	}
}

// checkNoResidue fails the test for anything of cfg's cluster still on the host.
func checkNoResidue(t *testing.T, cfg Config, env Env) {
	t.Helper()
	for _, n := range append(cfg.Nodes(), Node{Name: "sw"}) {
		if _, err := os.Stat(filepath.Join(env.NetnsRoot, "berth-"+cfg.Name+"-"+n.Name)); err == nil {
			t.Errorf("network namespace of %s left behind", n.Name)
		}
	}
	if _, err := os.Stat(filepath.Join(env.ClassNet, cfg.HostLink())); err == nil {
		t.Errorf("host link %s left behind", cfg.HostLink())
	}
	mi, _ := os.ReadFile(env.MountInfo)
	if strings.Contains(string(mi), cfg.Dir) {
		t.Errorf("mounts under %s left behind", cfg.Dir)
	}
	hs, _ := cgroupHierarchies(env.CgroupRoot)
	for _, h := range hs {
		if _, err := os.Stat(filepath.Join(h, cfg.ClusterCgroup())); err == nil {
			t.Errorf("cgroup %s left behind", filepath.Join(h, cfg.ClusterCgroup()))
		}
		if _, err := os.Stat(filepath.Join(h, "k8s.io")); err == nil {
			t.Errorf("cgroup %s left behind", filepath.Join(h, "k8s.io"))
		}
	}
	if _, err := os.Stat(cfg.Dir); err == nil {
		t.Errorf("cluster directory %s left behind", cfg.Dir)
	}
	if _, err := os.Stat(filepath.Join(env.Registry, cfg.Name)); err == nil {
		t.Errorf("registry entry left behind")
	}
}
