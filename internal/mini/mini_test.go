package mini

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/spf13/pflag"
	"go.uber.org/zap/zaptest"

	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/metadata"
)

func testConfig(dir string) Config {
	return Config{
		Name: "t", Dir: dir,
		Subnet:        netip.MustParsePrefix("198.51.100.0/24"),
		PodCIDR:       netip.MustParsePrefix(DefaultPodCIDR),
		ServiceCIDR:   netip.MustParsePrefix(DefaultServiceCIDR),
		ControlPlanes: 1, Workers: 2,
		Bins: Bins{K8s: "/cache/k8s/bin"},
	}
}

func TestConfigValidate(t *testing.T) {
	good := testConfig("/x")
	if err := good.Validate(); err != nil {
		t.Fatalf("valid config rejected: %v", err)
	}
	for name, mut := range map[string]func(*Config){
		"long name":     func(c *Config) { c.Name = "toolongname" },
		"upper name":    func(c *Config) { c.Name = "Mini" },
		"relative dir":  func(c *Config) { c.Dir = "rel" },
		"small subnet":  func(c *Config) { c.Subnet = netip.MustParsePrefix("198.51.100.0/28") },
		"v6 subnet":     func(c *Config) { c.Subnet = netip.MustParsePrefix("2001:db8::/64") },
		"no cp":         func(c *Config) { c.ControlPlanes = 0 },
		"neg workers":   func(c *Config) { c.Workers = -1 },
		"no pod cidr":   func(c *Config) { c.PodCIDR = netip.Prefix{} },
		"many workers":  func(c *Config) { c.Workers = 41 },
		"many cps":      func(c *Config) { c.ControlPlanes = 10 },
		"digit first":   func(c *Config) { c.Name = "1a" },
		"empty name":    func(c *Config) { c.Name = "" },
		"dash in name":  func(c *Config) { c.Name = "a-b" },
		"subnet absent": func(c *Config) { c.Subnet = netip.Prefix{} },
		"old k8s":       func(c *Config) { c.KubernetesVersion = "v1.34.2" },
		"k8s minor":     func(c *Config) { c.KubernetesVersion = "v1.36" },
		"k8s garbage":   func(c *Config) { c.KubernetesVersion = "latest" },
	} {
		c := good
		mut(&c)
		if err := c.Validate(); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: Validate() = %v, want ErrInvalidConfig", name, err)
		}
	}
}

// A cluster runs the release its config names, the default without one, and its images and
// containerd's sandbox image follow that release.
func TestConfigRelease(t *testing.T) {
	c := testConfig("/x")
	if got := c.Release().Kubernetes; got != "v1.37.2" {
		t.Errorf("default Release() = %s, want v1.37.2", got)
	}
	c.KubernetesVersion = "v1.36.3"
	if err := c.Validate(); err != nil {
		t.Fatalf("Validate() at v1.36.3 = %v", err)
	}
	r := c.Release()
	if r.Kubernetes != "v1.36.3" || r.Etcd != "3.6.8" || r.CoreDNS != "v1.14.2" {
		t.Errorf("Release() = %+v, want v1.36.3 with etcd 3.6.8 and CoreDNS v1.14.2", r)
	}
	if !strings.Contains(containerdConfig(r.Images().Pause), `sandbox_image = "registry.k8s.io/pause:3.10.2"`) {
		t.Error("containerd's sandbox image is not the release's pause image")
	}
}

func TestNodesAndAddresses(t *testing.T) {
	c := testConfig("/x")
	nodes := c.Nodes()
	want := []Node{
		{Name: "cp1", Role: metadata.RoleControlPlane, IP: netip.MustParseAddr("198.51.100.10")},
		{Name: "w1", Role: metadata.RoleWorker, IP: netip.MustParseAddr("198.51.100.11")},
		{Name: "w2", Role: metadata.RoleWorker, IP: netip.MustParseAddr("198.51.100.12")},
	}
	if len(nodes) != len(want) {
		t.Fatalf("Nodes() = %v", nodes)
	}
	for i := range want {
		if nodes[i] != want[i] {
			t.Errorf("node %d = %+v, want %+v", i, nodes[i], want[i])
		}
	}
	if got := c.HostPrefix().String(); got != "198.51.100.1/24" {
		t.Errorf("HostPrefix() = %s", got)
	}
	if got := c.MetadataURL(); got != "http://198.51.100.1:8099" {
		t.Errorf("MetadataURL() = %s", got)
	}
	// Interface names must fit IFNAMSIZ (15) for the longest allowed cluster name.
	c.Name = "abcdefgh"
	if l := len(c.HostLink()); l > 15 {
		t.Errorf("host link name %q is %d bytes", c.HostLink(), l)
	}
}

func TestCNIConflistRoutesOnlyClusterRanges(t *testing.T) {
	b, err := cniConflist(netip.MustParsePrefix("10.244.2.0/24"), netip.MustParsePrefix(DefaultPodCIDR), netip.MustParsePrefix(DefaultServiceCIDR), netip.MustParsePrefix(DefaultSubnet), 1450)
	if err != nil {
		t.Fatal(err)
	}
	var conf struct {
		Plugins []struct {
			Type             string `json:"type"`
			IsDefaultGateway bool   `json:"isDefaultGateway"`
			MTU              int    `json:"mtu"`
			IPAM             struct {
				Ranges [][]map[string]string `json:"ranges"`
				Routes []map[string]string   `json:"routes"`
			} `json:"ipam"`
		} `json:"plugins"`
	}
	if err := json.Unmarshal(b, &conf); err != nil {
		t.Fatal(err)
	}
	br := conf.Plugins[0]
	if br.Type != "bridge" || br.IsDefaultGateway || br.MTU != 1450 {
		t.Fatalf("bridge plugin = %+v", br)
	}
	if got := br.IPAM.Ranges[0][0]; got["subnet"] != "10.244.2.0/24" || got["gateway"] != "10.244.2.1" {
		t.Errorf("range = %v", got)
	}
	var dsts []string
	for _, r := range br.IPAM.Routes {
		dsts = append(dsts, r["dst"])
	}
	if strings.Join(dsts, ",") != "10.244.0.0/16,10.96.0.0/12,198.51.100.0/24" {
		t.Errorf("routes = %v, want only the pod, service and node ranges", dsts)
	}
}

func TestParseSubnetEnv(t *testing.T) {
	p, mtu, err := parseSubnetEnv([]byte("FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1500\nFLANNEL_IPMASQ=false\n"))
	if err != nil || p.String() != "10.244.1.0/24" || mtu != 1500 {
		t.Fatalf("parseSubnetEnv = %v %d %v", p, mtu, err)
	}
	if _, _, err := parseSubnetEnv([]byte("FLANNEL_MTU=1500\n")); err == nil {
		t.Error("missing FLANNEL_SUBNET accepted")
	}
}

func TestWriteCNIIsIdempotent(t *testing.T) {
	cfg := testConfig(t.TempDir())
	env := []byte("FLANNEL_SUBNET=10.244.3.1/24\nFLANNEL_MTU=1500\n")
	if err := writeCNI(cfg, "w1", env); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(cfg.NodeDir("w1"), "fs", "etc-cni-net.d", cniConfName)
	st1, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := writeCNI(cfg, "w1", env); err != nil {
		t.Fatal(err)
	}
	st2, _ := os.Stat(path)
	if !st1.ModTime().Equal(st2.ModTime()) {
		t.Error("unchanged config was rewritten")
	}
}

func TestHostsAndWrapper(t *testing.T) {
	c := testConfig("/x")
	h := string(hostsFile(c.Nodes()))
	for _, want := range []string{"198.51.100.10\tcp1\n", "198.51.100.12\tw2\n", "127.0.0.1\tlocalhost\n"} {
		if !strings.Contains(h, want) {
			t.Errorf("hosts file lacks %q:\n%s", want, h)
		}
	}
	w := string(kubeletWrapper("/c/bin/kubelet", "/berth/t/w1", "/c/nodes/w1/bin/state-dirs"))
	for _, want := range []string{
		"\n'/c/nodes/w1/bin/state-dirs'\n",
		"until ctr --address /run/containerd/containerd.sock version",
		`exec '/c/bin/kubelet' "$@" --cgroup-root='/berth/t/w1' --cgroup-driver=cgroupfs`,
	} {
		if !strings.Contains(w, want) {
			t.Errorf("kubelet wrapper lacks %q:\n%s", want, w)
		}
	}
	w = string(containerdWrapper("/c/nodes/w1/bin/state-dirs"))
	if !strings.Contains(w, "\n'/c/nodes/w1/bin/state-dirs'\necho $$ > '/run/berth-mini-containerd.pid'\nexec containerd --config /etc/containerd/config.toml\n") {
		t.Errorf("containerd wrapper = %s", w)
	}
	if got := shellQuote("a'b"); got != `'a'\''b'` {
		t.Errorf("shellQuote = %s", got)
	}
}

func TestParseStat(t *testing.T) {
	line := "1234 (my (odd) cmd) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615\n"
	state, st, err := parseStat(line)
	if err != nil || state != "S" || st != 987654 {
		t.Fatalf("parseStat = %q %d %v", state, st, err)
	}
	if _, _, err := parseStat("garbage"); err == nil {
		t.Error("garbage accepted")
	}
}

func TestMountHelpers(t *testing.T) {
	if got := unescapeMountPath(`/a\040b/c`); got != "/a b/c" {
		t.Errorf("unescape = %q", got)
	}
	dir := t.TempDir()
	got := missingDirs(filepath.Join(dir, "x", "y"))
	if len(got) != 2 || got[0] != filepath.Join(dir, "x") || got[1] != filepath.Join(dir, "x", "y") {
		t.Errorf("missingDirs = %v", got)
	}
	if got := missingDirs(dir); len(got) != 0 {
		t.Errorf("missingDirs(existing) = %v", got)
	}
}

// recorder is a Runner that records commands and starts nothing.
type recorder struct {
	// cgroupRoot is the fake cgroupfs whose cgroup.procs files a SIGKILL updates.
	cgroupRoot string
	// respond, when set, answers Run (called with the lock held).
	respond func(cmd Cmd) ([]byte, error)
	mu      sync.Mutex
	cmds    []string
	nextID  int
	alive   map[int]bool
	killed  []int
	// importers are the short-lived containerds that import images (no nsenter): SIGTERM ends them.
	importers map[int]bool
}

func (r *recorder) Run(_ context.Context, cmd Cmd) ([]byte, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cmds = append(r.cmds, cmd.String())
	if r.respond != nil {
		return r.respond(cmd)
	}
	return nil, nil
}

func (r *recorder) Start(cmd Cmd) (Proc, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cmds = append(r.cmds, "start "+cmd.String())
	r.nextID++
	if r.alive == nil {
		r.alive = map[int]bool{}
	}
	pid := 100000 + r.nextID
	r.alive[pid] = true
	if cmd.Path == "containerd" {
		if r.importers == nil {
			r.importers = map[int]bool{}
		}
		r.importers[pid] = true
	}
	for _, f := range cmd.Cgroups { // as the real Start's shell does before exec
		if err := os.WriteFile(f, []byte(strconv.Itoa(pid)), 0o644); err != nil {
			return Proc{}, err
		}
	}
	return Proc{PID: pid, StartTime: 1}, nil
}

func (r *recorder) Alive(p Proc) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.alive[p.PID]
}

func (r *recorder) Signal(p Proc, sig syscall.Signal) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if sig == syscall.SIGTERM && r.importers[p.PID] {
		delete(r.alive, p.PID)
		return nil
	}
	if sig != syscall.SIGKILL {
		return nil
	}
	if r.alive[p.PID] {
		r.killed = append(r.killed, p.PID)
	}
	delete(r.alive, p.PID)
	if r.cgroupRoot == "" {
		return nil
	}
	return filepath.WalkDir(r.cgroupRoot, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.Name() != "cgroup.procs" {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		var keep []string
		for _, f := range strings.Fields(string(b)) {
			if f != strconv.Itoa(p.PID) {
				keep = append(keep, f)
			}
		}
		return os.WriteFile(path, []byte(strings.Join(keep, "\n")), 0o644)
	})
}

func (r *recorder) all() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return strings.Join(r.cmds, "\n")
}

// fakeEnv returns an Env under a temporary root with two cgroup hierarchies.
func fakeEnv(t *testing.T) Env {
	root := t.TempDir()
	env := Env{
		CgroupRoot: filepath.Join(root, "cgroup"),
		NetnsRoot:  filepath.Join(root, "netns"),
		ClassNet:   filepath.Join(root, "net"),
		MountInfo:  filepath.Join(root, "mountinfo"),
		Registry:   filepath.Join(root, "registry"),
		Self:       "/usr/bin/berth",
		Root:       filepath.Join(root, "host"),
	}
	for _, h := range []string{"memory", "cpuset"} {
		if err := writeFile(filepath.Join(env.CgroupRoot, h, "cgroup.procs"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
		if err := writeFile(filepath.Join(env.CgroupRoot, "cpuset", f), []byte("0-1\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := writeFile(env.MountInfo, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return env
}

func TestUpCommandsAndDownFromState(t *testing.T) {
	env := fakeEnv(t)
	cfg := testConfig(filepath.Join(t.TempDir(), "cluster"))
	cfg.Bootstrapper = "/bin/bootstrapper"
	cfg.ImageArchive = "/cache/images.tar"
	rec := &recorder{cgroupRoot: env.CgroupRoot}
	cl := New(cfg, env, rec, zaptest.NewLogger(t))
	cl.dialer = func(context.Context, string) error { return nil }
	timings, err := cl.Up(context.Background(), UpOptions{InitSecret: []byte("s")})
	if err != nil {
		t.Fatalf("Up: %v", err)
	}
	if len(timings.Phases) != 10 {
		t.Errorf("phases = %v", timings.Phases)
	}
	cmds := rec.all()
	for _, want := range []string{
		"ip netns add berth-t-sw",
		"ip -n berth-t-sw link add br0 type bridge",
		"ip link add t-host type veth peer name uplink netns berth-t-sw",
		"ip addr add 198.51.100.1/24 dev t-host",
		"ip -n berth-t-sw link add w2 type veth peer name eth0 netns berth-t-w2",
		"ip -n berth-t-w2 addr add 198.51.100.12/24 dev eth0",
		"unshare --mount=" + cfg.MountNS("cp1") + " --uts=" + cfg.UTSNS("cp1") + " --propagation private true",
		"mount -t tmpfs -o mode=0755,size=256m tmpfs /run",
		// The state directories are read-only placeholders until the bootstrapper (or the node's
		// state-dirs script) binds the disk.
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/lib/containerd",
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/lib/cni",
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/log",
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/lib/kubelet",
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/lib/etcd",
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /etc/kubernetes",
		"mount -t tmpfs -o ro,mode=0700,size=4k berth-no-state-disk /var/lib/berth",
		"swtpm_setup --tpm2 --tpmstate " + filepath.Join(cfg.NodeDir("w1"), "tpm"),
		"start nsenter --net=" + filepath.Join(env.NetnsRoot, "berth-t-cp1") + " -- swtpm socket",
		// The images go into the cluster's seed root, once, on the host.
		"start containerd --config " + filepath.Join(cfg.SeedDir(), "config.toml"),
		"ctr --address " + filepath.Join(cfg.SeedDir(), "c.sock") + " --namespace k8s.io images import /cache/images.tar",
		"start /usr/bin/berth mini agent --dir " + cfg.Dir,
		"-- /bin/bootstrapper",
		"-- " + filepath.Join(cfg.NodeDir("w1"), "bin", "containerd"),
	} {
		if !strings.Contains(cmds, want) {
			t.Errorf("commands lack %q", want)
		}
	}
	if strings.Contains(cmds, "default") {
		t.Errorf("a command mentions a default route:\n%s", cmds)
	}
	for _, gone := range []string{"var-lib-kubelet", "var-lib-etcd", "etc-kubernetes", "var-lib-containerd", "var-lib-cni", "var-log"} {
		if strings.Contains(cmds, gone) {
			t.Errorf("node state is still bound from the host's %s:\n%s", gone, cmds)
		}
	}
	// Every state directory has a host mount point, recorded for Down.
	for _, d := range []string{"/etc/kubernetes", "/var/lib/kubelet", "/var/lib/etcd", "/var/lib/berth"} {
		if fi, err := os.Stat(filepath.Join(env.Root, d)); err != nil || !fi.IsDir() {
			t.Errorf("host mount point %s: %v", d, err)
		}
	}
	// Every node has a blank, sparse state disk of the default size.
	for _, n := range cfg.Nodes() {
		fi, err := os.Stat(cfg.StateDisk(n.Name))
		if err != nil {
			t.Fatalf("state disk of %s: %v", n.Name, err)
		}
		if fi.Size() != DefaultStateDiskSize {
			t.Errorf("state disk of %s is %d bytes, want %d", n.Name, fi.Size(), DefaultStateDiskSize)
		}
		if used := fi.Sys().(*syscall.Stat_t).Blocks * 512; used > 1<<20 {
			t.Errorf("state disk of %s uses %d bytes on the host; want a sparse file", n.Name, used)
		}
		if _, err := os.Stat(filepath.Join(cfg.NodeDir(n.Name), "state")); err == nil {
			t.Errorf("node %s has a host state directory", n.Name)
		}
	}
	// Node cgroups exist with inherited cpusets and hold the started daemons.
	cpus, err := os.ReadFile(filepath.Join(env.CgroupRoot, "cpuset", "berth", "t", "w2", "cpuset.cpus"))
	if err != nil || strings.TrimSpace(string(cpus)) != "0-1" {
		t.Errorf("cpuset.cpus = %q, %v", cpus, err)
	}
	st, err := LoadState(cfg.Dir)
	if err != nil {
		t.Fatal(err)
	}
	if st.Agent == nil || len(st.Procs["cp1"]) != 3 || st.InitSecretHash == "" || st.ControlPlaneEndpoint != "198.51.100.1:6443" {
		t.Fatalf("state = %+v", st)
	}
	env2 := cl.bootstrapperEnv(cfg.Nodes()[1])
	for _, want := range []string{"BERTH_METADATA=mini", "BERTH_METADATA_URL=http://198.51.100.1:8099", "BERTH_TPM=tcp:127.0.0.1:2321",
		"BERTH_CRI_SOCKET=unix:///run/containerd/containerd.sock", "BERTH_KUBELET=process", "BERTH_INIT_LISTEN=:9000",
		"BERTH_STATE_DISK=" + filepath.Join(cfg.Dir, "nodes", "w1", "state.img"), "BERTH_STATE_DISK_BACKEND=fscrypt",
		"BERTH_STATE_MOUNT=/run/berth/state-disk", "BERTH_STATE_DIR=/var/lib/berth", "BERTH_RECOVERY_LISTEN=:9001",
		"BERTH_SEAL_PCRS=4"} {
		if !slices.Contains(env2, want) {
			t.Errorf("bootstrapper env lacks %s", want)
		}
	}
	if strings.Contains(strings.Join(env2, "\n"), filepath.Join(cfg.NodeDir("w1"), "state")+"\n") {
		t.Errorf("bootstrapper env names the old host state directory: %v", env2)
	}
	// Nodes started before berth init check the joinservice against the image's join policy (no
	// attestation-key CA: the joinservice activates its key for them); berth init writes the
	// cluster's, which nodes started afterwards get, and its config names the image's as the base.
	if !slices.Contains(env2, "BERTH_JOIN_POLICY="+cfg.ImageJoinPolicyPath()) {
		t.Errorf("bootstrapper env before init lacks the image's join policy: %v", env2)
	}
	if b, err := os.ReadFile(cfg.ImageJoinPolicyPath()); err != nil || !strings.Contains(string(b), "nonZero: true") || strings.Contains(string(b), "akRoots") {
		t.Errorf("image join policy = %q, %v", b, err)
	}
	if err := os.WriteFile(cfg.JoinPolicyPath(), []byte("variant: tpm\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if env3 := cl.bootstrapperEnv(cfg.Nodes()[2]); !slices.Contains(env3, "BERTH_JOIN_POLICY="+cfg.JoinPolicyPath()) {
		t.Errorf("bootstrapper env after init lacks the cluster's join policy: %v", env3)
	}
	cl.cfg.Attestation = AttestationTPM
	if initCfg, err := cl.initConfig(); err != nil || !strings.Contains(string(initCfg), "joinPolicyFile: "+cfg.ImageJoinPolicyPath()+"\n") {
		t.Errorf("berth init's config does not name the image's join policy (%v):\n%s", err, initCfg)
	}
	if _, err := cl.Up(context.Background(), UpOptions{}); !errors.Is(err, ErrExists) {
		t.Errorf("second Up = %v, want ErrExists", err)
	}
	other := cfg
	other.Dir = filepath.Join(t.TempDir(), "other")
	if _, err := New(other, env, rec, zaptest.NewLogger(t)).Up(context.Background(), UpOptions{}); !errors.Is(err, ErrNameInUse) {
		t.Errorf("Up of a second cluster with the same name = %v, want ErrNameInUse", err)
	}

	// Down from the state file alone kills every recorded daemon and removes cgroups and files.
	cl2, err := Open(cfg.Dir, env, rec, zaptest.NewLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	cl2.rmdir = os.RemoveAll
	before := len(rec.all())
	if _, err := cl2.Down(context.Background()); err != nil {
		t.Fatalf("Down: %v", err)
	}
	downCmds := rec.all()[before:]
	for _, n := range cfg.Nodes() {
		if !strings.Contains(downCmds, "losetup -j "+cfg.StateDisk(n.Name)) {
			t.Errorf("Down did not check the loop devices of %s's state disk:\n%s", n.Name, downCmds)
		}
	}
	if len(rec.killed) != 10 { // agent + 3 daemons on each of 3 nodes
		t.Errorf("killed %d processes, want 10", len(rec.killed))
	}
	if _, err := os.Stat(filepath.Join(env.CgroupRoot, "memory", "berth")); err == nil {
		t.Error("cgroups left behind")
	}
	if _, err := os.Stat(cfg.Dir); err == nil {
		t.Error("cluster directory left behind")
	}
	// A second Down finds nothing.
	if _, err := Open(cfg.Dir, env, rec, zaptest.NewLogger(t)); !errors.Is(err, ErrNoState) {
		t.Errorf("Open after Down = %v, want ErrNoState", err)
	}
	if _, err := os.Stat(filepath.Join(env.Registry, cfg.Name)); err == nil {
		t.Error("registry entry left behind")
	}

	// A registry entry whose directory holds no cluster (a Down that stopped half-way) does not keep
	// the name: the next Up replaces it.
	if err := os.MkdirAll(env.Registry, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(env.Registry, cfg.Name), []byte(other.Dir+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cl3 := New(cfg, env, rec, zaptest.NewLogger(t))
	if _, err := cl3.Up(context.Background(), UpOptions{}); err != nil {
		t.Errorf("Up over a stale registry entry: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(env.Registry, cfg.Name)); strings.TrimSpace(string(b)) != cfg.Dir {
		t.Errorf("registry entry = %q, want %s", b, cfg.Dir)
	}
	cl3.rmdir = os.RemoveAll
	if _, err := cl3.Down(context.Background()); err != nil {
		t.Fatalf("Down: %v", err)
	}
}

// TestKubeletExtraArgs: the kubelet flags every node gets parse as the bootstrapper parses its
// environment (a pflag string slice, CSV): eviction-hard keeps its commas.
func TestKubeletExtraArgs(t *testing.T) {
	name, value, _ := strings.Cut(kubeletExtraArgsEnv, "=")
	if name != "BERTH_KUBELET_EXTRA_ARGS" {
		t.Fatalf("variable %s, want BERTH_KUBELET_EXTRA_ARGS (the bootstrapper's --kubelet-extra-args)", name)
	}
	fs := pflag.NewFlagSet("bootstrapper", pflag.ContinueOnError)
	args := fs.StringSlice("kubelet-extra-args", nil, "")
	if err := fs.Set("kubelet-extra-args", value); err != nil {
		t.Fatal(err)
	}
	want := []string{"eviction-hard=memory.available<100Mi,nodefs.available<1Gi,imagefs.available<1Gi",
		"image-gc-high-threshold=100", "image-gc-low-threshold=99"}
	if !slices.Equal(*args, want) {
		t.Fatalf("parsed %q, want %q", *args, want)
	}
}

// The upstream images carry the tags the cluster's release's kubeadm names, so kubeadm finds them
// imported and pulls nothing.
func TestImageSpecsFollowRelease(t *testing.T) {
	r, err := k8sversion.Lookup("v1.36")
	if err != nil {
		t.Fatal(err)
	}
	specs, err := ImageSpecs(Bins{K8s: "/k", Etcd: "/e", CoreDNS: "/c", Flannel: "/f", PodBin: "/p"}, r)
	if err != nil {
		t.Fatal(err) // nft is one of the mini cluster's host packages (scripts/install-deps.sh)
	}
	var tags []string
	for _, s := range specs {
		tags = append(tags, s.Tag)
	}
	for _, want := range []string{"registry.k8s.io/kube-apiserver:v1.36.3", "registry.k8s.io/kube-proxy:v1.36.3",
		"registry.k8s.io/etcd:3.6.8-0", "registry.k8s.io/coredns/coredns:v1.14.2", "registry.k8s.io/pause:3.10.2"} {
		if !slices.Contains(tags, want) {
			t.Errorf("ImageSpecs at v1.36.3 lacks %s: %v", want, tags)
		}
	}
}
