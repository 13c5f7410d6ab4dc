package mini

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"
)

// Env names the host locations the cluster touches besides its own directory. HostEnv returns the
// real ones; tests point them at temporary directories.
type Env struct {
	// CgroupRoot is where the cgroup v1 hierarchies are mounted (one directory per hierarchy).
	CgroupRoot string
	// NetnsRoot is where `ip netns` pins named network namespaces.
	NetnsRoot string
	// ClassNet lists the host's network interfaces.
	ClassNet string
	// MountInfo is the host's mount table.
	MountInfo string
	// Registry holds one file per live mini cluster, so that host mount points shared by all
	// clusters are removed only by the last one.
	Registry string
	// Self is the berth binary; up starts `Self mini agent --dir DIR` as the host daemon.
	Self string
	// AgentEnv is added to the agent's environment.
	AgentEnv []string
	// Root is the host's root directory, where missing mount points for the nodes are created.
	Root string
}

// HostEnv returns the real host locations.
func HostEnv() (Env, error) {
	self, err := os.Executable()
	if err != nil {
		return Env{}, fmt.Errorf("locating berth binary: %w", err)
	}
	return Env{
		CgroupRoot: "/sys/fs/cgroup",
		NetnsRoot:  "/run/netns",
		ClassNet:   "/sys/class/net",
		MountInfo:  "/proc/self/mountinfo",
		Registry:   "/run/berth-mini",
		Self:       self,
		Root:       "/",
	}, nil
}

// Cluster creates, restarts and removes one mini cluster.
type Cluster struct {
	cfg   Config
	env   Env
	run   Runner
	log   *zap.Logger
	state *State
	// dialer replaces the TCP readiness probe in tests.
	dialer func(ctx context.Context, addr string) error
	// rmdir replaces os.Remove for cgroup directories in tests (a fake cgroupfs has real files).
	rmdir func(string) error
	// initSecret is Up's init secret until prepare wrote it to the cluster directory.
	initSecret []byte
	// clearTPMs names the nodes whose TPM Restart clears before measuring their boot.
	clearTPMs map[string]bool
	// mu serializes changes to state while nodes are set up in parallel.
	mu sync.Mutex
}

// New returns a Cluster for cfg. Nothing happens until Up, Restart or Down.
func New(cfg Config, env Env, run Runner, log *zap.Logger) *Cluster {
	return &Cluster{cfg: cfg, env: env, run: run, log: log}
}

// Open returns the Cluster whose state file is in dir, for Down and Restart.
func Open(dir string, env Env, run Runner, log *zap.Logger) (*Cluster, error) {
	st, err := LoadState(dir)
	if err != nil {
		return nil, err
	}
	return &Cluster{cfg: st.Config, env: env, run: run, log: log, state: st}, nil
}

// Config returns the cluster's configuration.
func (c *Cluster) Config() Config { return c.cfg }

// Phase is one timed step of up or restart.
type Phase struct {
	Name     string
	Duration time.Duration
}

// Timings collects the phases of one operation in order.
type Timings struct {
	Phases []Phase
}

// Total is the sum of all phases.
func (t Timings) Total() time.Duration {
	var d time.Duration
	for _, p := range t.Phases {
		d += p.Duration
	}
	return d
}

func (t *Timings) run(name string, progress func(Phase), f func() error) error {
	start := time.Now()
	err := f()
	p := Phase{Name: name, Duration: time.Since(start)}
	t.Phases = append(t.Phases, p)
	if progress != nil {
		progress(p)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// UpOptions tune Up.
type UpOptions struct {
	// Progress is called after every phase.
	Progress func(Phase)
	// InitSecret is the secret whose hash the metadata API publishes; required with a bootstrapper.
	InitSecret []byte
}

// ErrNameInUse is returned by Up when another live cluster (or leftover of one) has the same name:
// the name determines namespaces, links and cgroups, so two clusters must never share it.
var ErrNameInUse = errors.New("another mini cluster uses this name (choose another --name, or remove it with berth mini down)")

// ErrExists is returned by Up when the directory already holds a cluster.
var ErrExists = errors.New("a mini cluster already exists in this directory (run berth mini down first)")

// Up creates the nodes: network, namespaces, cgroups, blank state disks, TPMs, the cluster's seed
// containerd root with every image imported, the host agent (metadata API and CNI configs), when
// configured each node's bootstrapper (which opens the node's state disk), and containerd, which
// runs on the state disk: Up returns once every node's containerd answers.
// On error the partly built cluster stays recorded; Down removes it.
func (c *Cluster) Up(ctx context.Context, opts UpOptions) (Timings, error) {
	var t Timings
	if err := c.cfg.Validate(); err != nil {
		return t, err
	}
	if _, err := LoadState(c.cfg.Dir); err == nil {
		return t, ErrExists
	} else if !errors.Is(err, ErrNoState) {
		return t, err
	}
	if b, err := os.ReadFile(filepath.Join(c.env.Registry, c.cfg.Name)); err == nil {
		owner := strings.TrimSpace(string(b))
		// Up saves its state before it registers and Down unregisters before it removes the state,
		// so an entry whose directory holds no state is what a Down that stopped half-way (or an
		// older Berth) left; with no namespace or link of the name either, nothing of it runs.
		if _, err := LoadState(owner); !errors.Is(err, ErrNoState) || c.netnsExists(c.cfg.SwitchNetns()) || c.linkExists(c.cfg.HostLink()) {
			return t, fmt.Errorf("%w: %s is in use by %s", ErrNameInUse, c.cfg.Name, owner)
		}
		c.log.Warn("replacing the registry entry of a cluster that no longer exists", zap.String("name", c.cfg.Name), zap.String("dir", owner))
	}
	if c.netnsExists(c.cfg.SwitchNetns()) || c.linkExists(c.cfg.HostLink()) {
		return t, fmt.Errorf("%w: %s or %s exists", ErrNameInUse, c.cfg.SwitchNetns(), c.cfg.HostLink())
	}
	c.state = &State{Config: c.cfg, Procs: map[string][]Proc{}}
	c.initSecret = opts.InitSecret
	if len(opts.InitSecret) > 0 {
		h := sha256.Sum256(opts.InitSecret)
		c.state.InitSecretHash = hex.EncodeToString(h[:])
	}
	nodes := c.cfg.Nodes()
	steps := []struct {
		name string
		f    func() error
	}{
		{"prepare", func() error { return c.prepare(ctx) }},
		{"network", func() error { return c.network(ctx, nodes) }},
		{"namespaces", func() error { return c.eachNode(nodes, func(n Node) error { return c.namespaces(ctx, n) }) }},
		{"cgroups", func() error { return c.eachNode(nodes, c.cgroups) }},
		{"disks", func() error { return c.eachNode(nodes, c.createStateDisk) }},
		{"tpm", func() error { return c.eachNodeParallel(ctx, nodes, c.tpm) }},
		{"seed", func() error { return c.seed(ctx, []string{c.cfg.BerthArchive}) }},
		{"agent", func() error { return c.agent(ctx) }},
		{"bootstrappers", func() error { return c.eachNode(nodes, c.bootstrapper) }},
		{"containerd", func() error { return c.containerd(ctx, nodes, true) }},
	}
	for _, s := range steps {
		if err := t.run(s.name, opts.Progress, s.f); err != nil {
			return t, err
		}
	}
	return t, nil
}

// eachNodeParallel runs f for every node at once and returns the first error after all finished.
func (c *Cluster) eachNodeParallel(ctx context.Context, nodes []Node, f func(context.Context, Node) error) error {
	g, gctx := errgroup.WithContext(ctx)
	for _, n := range nodes {
		g.Go(func() error {
			if err := f(gctx, n); err != nil {
				return fmt.Errorf("node %s: %w", n.Name, err)
			}
			return nil
		})
	}
	return g.Wait()
}

func (c *Cluster) eachNode(nodes []Node, f func(Node) error) error {
	for _, n := range nodes {
		if err := f(n); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	return nil
}

// prepare creates the cluster directory, the state file, the registry entry, the private mount
// that pins node namespaces and the host mount points the nodes bind over.
func (c *Cluster) prepare(ctx context.Context) error {
	if _, err := os.Stat(c.cfg.Dir); errors.Is(err, fs.ErrNotExist) {
		c.state.CreatedDir = true
		missing := missingDirs(c.cfg.Dir)
		c.state.CreatedParents = missing[:len(missing)-1]
	}
	if err := os.MkdirAll(c.cfg.Dir, 0o755); err != nil {
		return fmt.Errorf("creating cluster directory: %w", err)
	}
	if err := c.state.save(); err != nil {
		return err
	}
	unlock, err := c.lockRegistry()
	if err != nil {
		return err
	}
	if err := writeFile(filepath.Join(c.env.Registry, c.cfg.Name), []byte(c.cfg.Dir+"\n"), 0o644); err != nil {
		unlock()
		return fmt.Errorf("registering cluster: %w", err)
	}
	err = c.ensureHostDirs()
	unlock()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.cfg.NSDir(), 0o755); err != nil {
		return fmt.Errorf("creating namespace directory: %w", err)
	}
	if !c.mounted(c.cfg.NSDir()) {
		if _, err := c.run.Run(ctx, Cmd{Path: "mount", Args: []string{"--bind", c.cfg.NSDir(), c.cfg.NSDir()}}); err != nil {
			return fmt.Errorf("pinning namespace directory: %w", err)
		}
	}
	if _, err := c.run.Run(ctx, Cmd{Path: "mount", Args: []string{"--make-private", c.cfg.NSDir()}}); err != nil {
		return fmt.Errorf("making namespace directory private: %w", err)
	}
	if err := c.writeInitSecret(c.initSecret); err != nil {
		return err
	}
	if err := writeFile(filepath.Join(c.cfg.ComponentsDir(), "10-flannel.yaml"), flannelManifest(c.cfg.PodCIDR, c.cfg.ControlPlaneEndpoint()), 0o644); err != nil {
		return err
	}
	ca := c.cfg.TPMCADir()
	for name, b := range map[string][]byte{
		"swtpm_setup.conf":      swtpmSetupConf(ca),
		"swtpm-localca.conf":    swtpmLocalCAConf(ca),
		"swtpm-localca.options": swtpmLocalCAOptions(),
	} {
		if err := writeFile(filepath.Join(ca, name), b, 0o644); err != nil {
			return fmt.Errorf("writing TPM CA configuration: %w", err)
		}
	}
	return nil
}

// ensureHostDirs creates the host mount points the nodes mount over that the host lacks, recording
// each before it is created (in the state file and the registry's ledger) so that Down removes it.
// The caller holds the registry lock.
func (c *Cluster) ensureHostDirs() error {
	for _, m := range nodeMounts {
		if m.tmpfs || m.file {
			continue
		}
		missing := missingDirs(filepath.Join(c.env.Root, m.dst))
		if len(missing) == 0 {
			continue
		}
		// Record before creating: a crash in between must still let Down remove them.
		c.state.HostDirs = append(c.state.HostDirs, missing...)
		if err := c.state.save(); err != nil {
			return err
		}
		if err := appendLines(filepath.Join(c.env.Registry, hostDirsLedger), missing); err != nil {
			return fmt.Errorf("recording host mount points: %w", err)
		}
		if err := os.MkdirAll(filepath.Join(c.env.Root, m.dst), 0o755); err != nil {
			return fmt.Errorf("creating mount point %s: %w", m.dst, err)
		}
	}
	return nil
}

// ensureHostDirsLocked is ensureHostDirs under the registry lock, for operations on a running
// cluster (restart, add): a cluster made by an older berth may lack a newer mount point.
func (c *Cluster) ensureHostDirsLocked() error {
	unlock, err := c.lockRegistry()
	if err != nil {
		return err
	}
	defer unlock()
	return c.ensureHostDirs()
}

// hostDirsLedger (in the registry) lists every host mount point any mini cluster created; the last
// cluster to go removes them, also those an earlier, already removed cluster created.
const hostDirsLedger = ".hostdirs"

// lockRegistry takes the registry's exclusive lock; clusters register and unregister under it.
func (c *Cluster) lockRegistry() (func(), error) {
	if err := os.MkdirAll(c.env.Registry, 0o755); err != nil {
		return nil, fmt.Errorf("creating cluster registry: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(c.env.Registry, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening registry lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("locking registry: %w", err)
	}
	return func() { f.Close() }, nil
}

func appendLines(path string, lines []string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(strings.Join(lines, "\n") + "\n"); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// missingDirs returns the directories MkdirAll(p) would create, outermost first.
func missingDirs(p string) []string {
	var missing []string
	for d := filepath.Clean(p); d != "/" && d != "."; d = filepath.Dir(d) {
		if _, err := os.Lstat(d); err == nil {
			break
		}
		missing = append([]string{d}, missing...)
	}
	return missing
}

// nodeMount is one directory (or file) a node sees in place of the host's.
type nodeMount struct {
	dst   string // path inside the node
	src   string // name under the node's fs directory
	file  bool   // a single file, bind-mounted
	tmpfs bool   // a fresh tmpfs (volatile, like a machine's /run)
	// placeholder is an empty read-only tmpfs: the node's bootstrapper (or, for diskDirs, the
	// node's state-dirs script) binds a directory of its opened state disk over it, so a node whose
	// disk is not open fails to write instead of writing unencrypted state.
	placeholder bool
}

// nodeMounts are applied in order inside each node's mount namespace. Everything the node's
// cluster components write is a placeholder, later on the state disk; what stays a host directory
// is written by the host (containerd's and the CNI's configuration, /etc/hosts) or read-only.
var nodeMounts = []nodeMount{
	{dst: "/run", tmpfs: true},
	{dst: "/etc/kubernetes", placeholder: true},
	{dst: "/etc/containerd", src: "etc-containerd"},
	{dst: "/etc/cni/net.d", src: "etc-cni-net.d"},
	{dst: "/var/lib/kubelet", placeholder: true},
	{dst: "/var/lib/containerd", placeholder: true},
	{dst: "/var/lib/cni", placeholder: true},
	{dst: "/var/lib/etcd", placeholder: true},
	{dst: NodeStateDir, placeholder: true},
	{dst: "/var/log", placeholder: true},
	{dst: "/usr/lib/modules", src: "lib-modules"},
	{dst: "/etc/hosts", src: "hosts", file: true},
	{dst: "/etc/resolv.conf", src: "resolv.conf", file: true},
}

// mountArgs are the arguments of the mount command that applies m inside a node.
func (m nodeMount) mountArgs(fsDir string) []string {
	switch {
	case m.tmpfs:
		return []string{"-t", "tmpfs", "-o", "mode=0755,size=256m", "tmpfs", m.dst}
	case m.placeholder:
		return []string{"-t", "tmpfs", "-o", "ro,mode=0700,size=4k", "berth-no-state-disk", m.dst}
	}
	return []string{"--bind", filepath.Join(fsDir, m.src), m.dst}
}

// fsDir is the host directory behind a node's bind mounts.
func (c *Cluster) fsDir(node string) string { return filepath.Join(c.cfg.NodeDir(node), "fs") }

// mounted reports whether path is a mount point in the host's mount table.
func (c *Cluster) mounted(path string) bool {
	b, err := os.ReadFile(c.env.MountInfo)
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && unescapeMountPath(f[4]) == path {
			return true
		}
	}
	return false
}

// unescapeMountPath undoes the octal escapes (\040 for space and so on) of /proc/self/mountinfo.
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func (c *Cluster) netnsExists(name string) bool {
	_, err := os.Stat(filepath.Join(c.env.NetnsRoot, name))
	return err == nil
}

func (c *Cluster) linkExists(name string) bool {
	_, err := os.Stat(filepath.Join(c.env.ClassNet, name))
	return err == nil
}

func (c *Cluster) ip(ctx context.Context, args ...string) error {
	_, err := c.run.Run(ctx, Cmd{Path: "ip", Args: args})
	return err
}

// network creates the switch namespace with its bridge, the host's veth into it and every node's
// network namespace with its veth, address and sysctls. No default route is added anywhere.
func (c *Cluster) network(ctx context.Context, nodes []Node) error {
	sw := c.cfg.SwitchNetns()
	if !c.netnsExists(sw) {
		steps := [][]string{
			{"netns", "add", sw},
			{"-n", sw, "link", "set", "lo", "up"},
			{"-n", sw, "link", "add", "br0", "type", "bridge"},
			{"-n", sw, "link", "set", "br0", "up"},
		}
		for _, s := range steps {
			if err := c.ip(ctx, s...); err != nil {
				return fmt.Errorf("creating switch: %w", err)
			}
		}
	}
	if !c.linkExists(c.cfg.HostLink()) {
		steps := [][]string{
			{"link", "add", c.cfg.HostLink(), "type", "veth", "peer", "name", "uplink", "netns", sw},
			{"addr", "add", c.cfg.HostPrefix().String(), "dev", c.cfg.HostLink()},
			{"link", "set", c.cfg.HostLink(), "up"},
			{"-n", sw, "link", "set", "uplink", "master", "br0", "up"},
		}
		for _, s := range steps {
			if err := c.ip(ctx, s...); err != nil {
				return fmt.Errorf("connecting host to switch: %w", err)
			}
		}
	}
	for _, n := range nodes {
		if err := c.nodeNetwork(ctx, n); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
	}
	return nil
}

func (c *Cluster) nodeNetwork(ctx context.Context, n Node) error {
	ns, sw := c.cfg.NodeNetns(n.Name), c.cfg.SwitchNetns()
	if c.netnsExists(ns) {
		return nil
	}
	addr := fmt.Sprintf("%s/%d", n.IP, c.cfg.Subnet.Bits())
	steps := [][]string{
		{"netns", "add", ns},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", sw, "link", "add", n.Name, "type", "veth", "peer", "name", "eth0", "netns", ns},
		{"-n", sw, "link", "set", n.Name, "master", "br0", "up"},
		{"-n", ns, "addr", "add", addr, "dev", "eth0"},
		{"-n", ns, "link", "set", "eth0", "up"},
		// Services are reached through kube-proxy's DNAT; locally generated packets need a route to
		// the service range before that rewrite happens. The range stays on the node network.
		{"-n", ns, "route", "add", c.cfg.ServiceCIDR.Masked().String(), "dev", "eth0"},
	}
	for _, s := range steps {
		if err := c.ip(ctx, s...); err != nil {
			return fmt.Errorf("creating network namespace: %w", err)
		}
	}
	if _, err := c.run.Run(ctx, Cmd{Path: "nsenter", Args: []string{"--net=" + filepath.Join(c.env.NetnsRoot, ns), "--",
		"sysctl", "-q", "-w", "net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1"}}); err != nil {
		return fmt.Errorf("setting node sysctls: %w", err)
	}
	return nil
}

// nsenter returns the argument prefix that runs a command inside node n: its network, mount and
// UTS namespaces.
func (c *Cluster) nsenter(n string) []string {
	return []string{"--net=" + filepath.Join(c.env.NetnsRoot, c.cfg.NodeNetns(n)), "--mount=" + c.cfg.MountNS(n),
		"--uts=" + c.cfg.UTSNS(n), "--"}
}

// namespaces creates node n's private mount and UTS namespaces (pinned by files in NSDir), mounts
// its directories over the host's and sets its host name.
func (c *Cluster) namespaces(ctx context.Context, n Node) error {
	fsDir := c.fsDir(n.Name)
	for _, m := range nodeMounts {
		switch {
		case m.tmpfs, m.placeholder:
		case m.file:
			var b []byte
			switch m.src {
			case "hosts":
				b = hostsFile(c.cfg.Nodes())
			case "resolv.conf":
				b = resolvConf(c.cfg.HostAddr())
			}
			if err := writeFile(filepath.Join(fsDir, m.src), b, 0o644); err != nil {
				return err
			}
		default:
			if err := os.MkdirAll(filepath.Join(fsDir, m.src), 0o755); err != nil {
				return fmt.Errorf("creating node directory: %w", err)
			}
		}
	}
	if err := writeFile(filepath.Join(fsDir, "etc-containerd", "config.toml"), []byte(containerdConfig(c.cfg.Release().Images().Pause)), 0o644); err != nil {
		return err
	}
	for _, f := range []string{c.cfg.MountNS(n.Name), c.cfg.UTSNS(n.Name)} {
		if err := writeFile(f, nil, 0o600); err != nil {
			return fmt.Errorf("creating namespace file: %w", err)
		}
	}
	if _, err := c.run.Run(ctx, Cmd{Path: "unshare", Args: []string{"--mount=" + c.cfg.MountNS(n.Name),
		"--uts=" + c.cfg.UTSNS(n.Name), "--propagation", "private", "true"}}); err != nil {
		return fmt.Errorf("creating mount namespace: %w", err)
	}
	mnt := []string{"--mount=" + c.cfg.MountNS(n.Name), "--"}
	for _, m := range nodeMounts {
		if _, err := c.run.Run(ctx, Cmd{Path: "nsenter", Args: append(append(mnt, "mount"), m.mountArgs(fsDir)...)}); err != nil {
			return fmt.Errorf("mounting %s: %w", m.dst, err)
		}
	}
	if _, err := c.run.Run(ctx, Cmd{Path: "nsenter", Args: []string{"--uts=" + c.cfg.UTSNS(n.Name), "--", "hostname", n.Name}}); err != nil {
		return fmt.Errorf("setting host name: %w", err)
	}
	return nil
}
