package mini

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	kwait "k8s.io/apimachinery/pkg/util/wait"

	"github.com/berth-k8s/berth/internal/kmsplugin"
)

// cgroupHierarchies lists the cgroup hierarchies under root (directories holding cgroup.procs): the
// v1 hierarchies and, on a hybrid host, the v2 "unified" one, where runc mirrors container cgroups.
func cgroupHierarchies(root string) ([]string, error) {
	entries, err := os.ReadDir(root)
	if err != nil {
		return nil, fmt.Errorf("listing cgroup hierarchies: %w", err)
	}
	var hs []string
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(root, e.Name(), "cgroup.procs")); err == nil {
			hs = append(hs, filepath.Join(root, e.Name()))
		}
	}
	return hs, nil
}

// cgroups creates node n's cgroup in every hierarchy; cpuset levels inherit their parent's CPUs
// and memory nodes, which cgroup v1 does not do by itself.
func (c *Cluster) cgroups(n Node) error {
	hs, err := cgroupHierarchies(c.env.CgroupRoot)
	if err != nil {
		return err
	}
	rel := strings.Split(strings.Trim(c.cfg.CgroupPath(n.Name), "/"), "/")
	for _, h := range hs {
		dir := h
		for _, part := range rel {
			parent := dir
			dir = filepath.Join(dir, part)
			if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				return fmt.Errorf("creating cgroup %s: %w", dir, err)
			}
			if filepath.Base(h) == "cpuset" {
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					if err := inheritCgroupValue(parent, dir, f); err != nil {
						return err
					}
				}
			}
		}
	}
	return nil
}

func inheritCgroupValue(parent, dir, file string) error {
	cur, err := os.ReadFile(filepath.Join(dir, file))
	if err == nil && strings.TrimSpace(string(cur)) != "" {
		return nil
	}
	v, err := os.ReadFile(filepath.Join(parent, file))
	if err != nil {
		return fmt.Errorf("reading %s of %s: %w", file, parent, err)
	}
	if err := os.WriteFile(filepath.Join(dir, file), v, 0o644); err != nil {
		return fmt.Errorf("writing %s of %s: %w", file, dir, err)
	}
	return nil
}

// cgroupProcs lists node n's cgroup.procs files, one per hierarchy.
func (c *Cluster) cgroupProcs(n string) ([]string, error) {
	hs, err := cgroupHierarchies(c.env.CgroupRoot)
	if err != nil {
		return nil, err
	}
	var fs []string
	for _, h := range hs {
		fs = append(fs, filepath.Join(h, c.cfg.CgroupPath(n), "cgroup.procs"))
	}
	return fs, nil
}

// cgroupPIDs lists every process in the cgroup subtree rel of every hierarchy.
func (c *Cluster) cgroupPIDs(rel string) []int {
	hs, err := cgroupHierarchies(c.env.CgroupRoot)
	if err != nil {
		return nil
	}
	seen := map[int]bool{}
	var pids []int
	for _, h := range hs {
		_ = filepath.WalkDir(filepath.Join(h, rel), func(p string, d os.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			b, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
			if err != nil {
				return nil
			}
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 1 && !seen[pid] {
					seen[pid] = true
					pids = append(pids, pid)
				}
			}
			return nil
		})
	}
	return pids
}

func (c *Cluster) logDir(n string) string { return filepath.Join(c.cfg.NodeDir(n), "logs") }

// startDaemon starts cmd for node n (or the host when n is empty) inside the node's cgroup and
// records it in the state file.
func (c *Cluster) startDaemon(n, name string, cmd Cmd) (Proc, error) {
	if n != "" {
		cgs, err := c.cgroupProcs(n)
		if err != nil {
			return Proc{}, err
		}
		cmd.Cgroups = cgs
	}
	p, err := c.run.Start(cmd)
	if err != nil {
		return Proc{}, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	p.Name = name
	if n == "" {
		c.state.Agent = &p
	} else {
		c.state.Procs[n] = append(c.state.Procs[n], p)
	}
	if err := c.state.save(); err != nil {
		return p, err
	}
	return p, nil
}

// tpm manufactures node n's TPM on first use (EK and platform certificates from the mini-local CA),
// starts swtpm on the node's own loopback, clears the TPM when a restart asked for it, and measures
// the node's simulated boot.
func (c *Cluster) tpm(ctx context.Context, n Node) error {
	dir := filepath.Join(c.cfg.NodeDir(n.Name), "tpm")
	if _, err := os.Stat(filepath.Join(dir, "tpm2-00.permall")); err != nil {
		ek := filepath.Join(c.cfg.NodeDir(n.Name), "ek")
		for _, d := range []string{dir, ek, c.logDir(n.Name)} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return fmt.Errorf("creating TPM directory: %w", err)
			}
		}
		if _, err := c.run.Run(ctx, Cmd{Path: "swtpm_setup", Args: []string{"--tpm2", "--tpmstate", dir,
			"--create-ek-cert", "--create-platform-cert", "--config", filepath.Join(c.cfg.TPMCADir(), "swtpm_setup.conf"),
			"--not-overwrite", "--write-ek-cert-files", ek}}); err != nil {
			return fmt.Errorf("manufacturing TPM: %w", err)
		}
	}
	netns := filepath.Join(c.env.NetnsRoot, c.cfg.NodeNetns(n.Name))
	_, err := c.startDaemon(n.Name, "swtpm", Cmd{
		Path: "nsenter",
		Args: []string{"--net=" + netns, "--", "swtpm", "socket", "--tpm2", "--tpmstate", "dir=" + dir,
			"--server", fmt.Sprintf("type=tcp,port=%d,bindaddr=127.0.0.1", TPMPort),
			"--ctrl", fmt.Sprintf("type=tcp,port=%d,bindaddr=127.0.0.1", TPMPort+1),
			"--flags", "not-need-init,startup-clear"},
		Log: filepath.Join(c.logDir(n.Name), "swtpm.log"),
	})
	if err != nil {
		return fmt.Errorf("starting swtpm: %w", err)
	}
	if c.clearTPMs[n.Name] { // set before the nodes' TPMs start
		if err := c.clearTPM(ctx, n); err != nil {
			return err
		}
	}
	return c.measureBoot(ctx, n)
}

// ctr returns the command running ctr against node n's containerd.
func (c *Cluster) ctr(n string, args ...string) Cmd {
	return Cmd{Path: "nsenter", Args: append([]string{"--mount=" + c.cfg.MountNS(n), "--", "ctr",
		"--address", "/run/containerd/containerd.sock", "--namespace", "k8s.io"}, args...)}
}

// stateDirs writes node n's state-dirs script (stateDirsScript) and returns its host path. Without
// a bootstrapper nothing opens a state disk: the node's directories are then the host's, under its
// fs directory (development only), and its containerd root is seeded here, with hard links.
func (c *Cluster) stateDirs(n string) (string, error) {
	path := filepath.Join(c.cfg.NodeDir(n), "bin", "state-dirs")
	root, wait := StateDiskRoot, true
	if c.cfg.Bootstrapper == "" {
		root, wait = c.fsDir(n), false
		dst := filepath.Join(root, "var-lib-containerd")
		if _, err := os.Stat(dst); errors.Is(err, os.ErrNotExist) {
			if err := SeedContainerdRoot(filepath.Join(c.cfg.SeedDir(), "root"), dst); err != nil {
				return "", fmt.Errorf("seeding containerd root: %w", err)
			}
		}
	}
	if err := writeFile(path, stateDirsScript(root, c.cfg.SeedDir(), wait), 0o755); err != nil {
		return "", err
	}
	return path, nil
}

// containerd starts every node's containerd through its wrapper, which first waits for the node's
// state disk and binds containerd's root, the CNI state and /var/log from it. With wait, it then
// waits until each answers (fresh nodes, whose bootstrappers open their blank disks at once); a
// restarted node's disk may wait for a rejoin or berth recover, and its kubelet waits for it.
func (c *Cluster) containerd(ctx context.Context, nodes []Node, wait bool) error {
	for _, n := range nodes {
		if err := os.MkdirAll(c.logDir(n.Name), 0o755); err != nil {
			return fmt.Errorf("creating log directory: %w", err)
		}
		stateDirs, err := c.stateDirs(n.Name)
		if err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
		wrapper := filepath.Join(c.cfg.NodeDir(n.Name), "bin", "containerd")
		if err := writeFile(wrapper, containerdWrapper(stateDirs), 0o755); err != nil {
			return fmt.Errorf("node %s: %w", n.Name, err)
		}
		if _, err := c.startDaemon(n.Name, "containerd", Cmd{
			Path: "nsenter",
			Args: append(c.nsenter(n.Name), wrapper),
			Log:  filepath.Join(c.logDir(n.Name), "containerd.log"),
		}); err != nil {
			return fmt.Errorf("node %s: starting containerd: %w", n.Name, err)
		}
	}
	if !wait {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, containerdTimeout)
	defer cancel()
	for _, n := range nodes {
		var last error
		err := kwait.PollUntilContextCancel(wctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			_, last = c.run.Run(ctx, c.ctr(n.Name, "version"))
			return last == nil, nil
		})
		if err != nil {
			return fmt.Errorf("node %s: waiting for containerd: %w (last: %w)", n.Name, err, last)
		}
	}
	return nil
}

// containerdTimeout bounds the wait for fresh nodes' containerd: the bootstrapper formats the
// state disk, then the seed root is copied onto it.
const containerdTimeout = 5 * time.Minute

// seed imports archives (and, the first time, the golden root's images) into the cluster's seed
// containerd root on the host, from which every node's state disk gets its containerd root. The
// exclusive lock keeps nodes from copying it half-written.
func (c *Cluster) seed(ctx context.Context, archives []string) error {
	dir := c.cfg.SeedDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("creating seed directory: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("opening seed lock: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("locking seed root: %w", err)
	}
	root := filepath.Join(dir, "root")
	if _, err := os.Stat(root); errors.Is(err, os.ErrNotExist) {
		if c.cfg.GoldenRoot != "" {
			if err := SeedContainerdRoot(c.cfg.GoldenRoot, root); err != nil {
				return fmt.Errorf("seeding containerd root: %w", err)
			}
		} else {
			archives = append([]string{c.cfg.ImageArchive}, archives...)
		}
	}
	var todo []string
	for _, a := range archives {
		if a != "" {
			todo = append(todo, a)
		}
	}
	if len(todo) == 0 {
		return os.MkdirAll(root, 0o755)
	}
	return importImages(ctx, c.run, dir, todo)
}

// agent starts the host daemon (metadata API, CNI configs) and waits until it listens.
func (c *Cluster) agent(ctx context.Context) error {
	if c.state.ControlPlaneEndpoint == "" {
		c.state.ControlPlaneEndpoint = c.cfg.ControlPlaneEndpoint().String()
	}
	if _, err := c.startDaemon("", "agent", Cmd{
		Path: c.env.Self,
		Args: []string{"mini", "agent", "--dir", c.cfg.Dir},
		Env:  c.env.AgentEnv,
		Log:  filepath.Join(c.cfg.Dir, "agent.log"),
	}); err != nil {
		return fmt.Errorf("starting agent: %w", err)
	}
	addr := netip.AddrPortFrom(c.cfg.HostAddr(), MetadataPort).String()
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if err := kwait.PollUntilContextCancel(wctx, 50*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		return c.dial(ctx, addr) == nil, nil
	}); err != nil {
		return fmt.Errorf("waiting for agent on %s: %w", addr, err)
	}
	return nil
}

// dial checks that something accepts TCP connections at addr (an address on the cluster's own
// bridge, never outside).
func (c *Cluster) dial(ctx context.Context, addr string) error {
	if c.dialer != nil {
		return c.dialer(ctx, addr)
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return conn.Close()
}

// bootstrapper writes node n's kubelet wrapper and, when the cluster has a bootstrapper binary,
// starts it inside the node with the mini platform's settings.
func (c *Cluster) bootstrapper(n Node) error {
	nodeDir := c.cfg.NodeDir(n.Name)
	kubelet := filepath.Join(nodeDir, "bin", "kubelet")
	stateDirs, err := c.stateDirs(n.Name)
	if err != nil {
		return err
	}
	if err := writeFile(kubelet, kubeletWrapper(filepath.Join(c.cfg.Bins.K8s, "kubelet"), c.cfg.CgroupPath(n.Name), stateDirs), 0o755); err != nil {
		return err
	}
	if c.cfg.Bootstrapper == "" {
		return nil
	}
	if err := writeFile(c.cfg.ImageJoinPolicyPath(), c.joinPolicyFile(), 0o644); err != nil {
		return err
	}
	if _, err := c.startDaemon(n.Name, "bootstrapper", Cmd{
		Path: "nsenter",
		Args: append(c.nsenter(n.Name), c.cfg.Bootstrapper),
		Env:  c.bootstrapperEnv(n),
		Log:  filepath.Join(c.logDir(n.Name), "bootstrapper.log"),
	}); err != nil {
		return fmt.Errorf("starting bootstrapper: %w", err)
	}
	return nil
}

// bootstrapperEnv is the daemon configuration of node n (CONTRIBUTING's BERTH_* settings).
func (c *Cluster) bootstrapperEnv(n Node) []string {
	nodeDir := c.cfg.NodeDir(n.Name)
	attestation := c.cfg.Attestation
	if attestation == "" {
		attestation = AttestationTPM
	}
	env := []string{
		"BERTH_METADATA=mini",
		"BERTH_METADATA_URL=" + c.cfg.MetadataURL(),
		"BERTH_ATTESTATION=" + attestation,
		fmt.Sprintf("BERTH_TPM=tcp:127.0.0.1:%d", TPMPort),
		// The state disk: a host path (the node sees every host path outside its own mounts),
		// opened and bound over the node's state directories by the bootstrapper's first phase.
		"BERTH_STATE_DISK=" + c.cfg.StateDisk(n.Name),
		"BERTH_STATE_DISK_BACKEND=" + StateDiskBackend,
		"BERTH_STATE_MOUNT=" + StateDiskMount,
		"BERTH_STATE_DIR=" + NodeStateDir,
		fmt.Sprintf("BERTH_RECOVERY_LISTEN=:%d", RecoveryPort),
		// The disk key is sealed to the simulated boot's measurement.
		fmt.Sprintf("BERTH_SEAL_PCRS=%d", BootPCR),
		"BERTH_KUBELET=process",
		"BERTH_KUBELET_PATH=" + filepath.Join(nodeDir, "bin", "kubelet"),
		"BERTH_KUBEADM_PATH=" + filepath.Join(c.cfg.Bins.K8s, "kubeadm"),
		"BERTH_CRI_SOCKET=" + CRISocket,
		// containerd's root is on the state disk: a node locked by a REVOKED check-in stops it.
		"BERTH_CONTAINER_RUNTIME_PIDFILE=" + ContainerdPidFile,
		fmt.Sprintf("BERTH_INIT_LISTEN=:%d", InitPort),
		"BERTH_CGROUP_DRIVER=cgroupfs",
		"BERTH_KUBE_PROXY_MODE=nftables",
		// Namespace nodes share the host's kernel: kube-proxy must not size nf_conntrack_max.
		"BERTH_KUBE_PROXY_CONNTRACK_MAX_PER_CORE=0",
		"BERTH_NEVER_PULL=true",
		// The kubelet's default thresholds are a share of its file system (less than 15 % free:
		// evict pods; more than 85 % used: delete images): on a host disk 86 % full they evicted
		// every test pod. Its file system is the node's state disk now, which is small. They
		// evict when less than 1 GiB is left, and never delete images (imported, not pullable).
		kubeletExtraArgsEnv,
		// Namespace nodes share the host's kernel, swap and hostname rules; kubeadm's checks for a
		// dedicated machine do not apply.
		"BERTH_KUBEADM_IGNORE_PREFLIGHT_ERRORS=all",
		"BERTH_COMPONENTS_DIR=" + c.cfg.ComponentsDir(),
		"BERTH_JOINSERVICE_IMAGE=" + ImageJoinService,
		"BERTH_WEBHOOK_IMAGE=" + c.cfg.WebhookImage, // empty: the webhook is not installed
		// A control plane's KMS plugin serves its metrics on the node's address, for the host to scrape.
		"BERTH_KMS_METRICS_LISTEN=" + netip.AddrPortFrom(n.IP, kmsplugin.MetricsPort).String(),
		"PATH=" + c.cfg.Bins.K8s + ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	}
	if attestation == AttestationTPM {
		// What this node demands of the joinservice before it joins: the cluster's join policy once
		// berth init wrote it (a node created after init), else the image's (one created before).
		joinPolicy := c.cfg.ImageJoinPolicyPath()
		if _, err := os.Stat(c.cfg.JoinPolicyPath()); err == nil {
			joinPolicy = c.cfg.JoinPolicyPath()
		}
		env = append(env, "BERTH_JOIN_POLICY="+joinPolicy, fmt.Sprintf("BERTH_LOCK_PCR=%d", LockPCR))
	}
	return env
}

// kubeletExtraArgsEnv gives every node's kubelet absolute eviction thresholds and turns image
// garbage collection off (the bootstrapper's --kubelet-extra-args, a CSV list: the quoted field keeps
// eviction-hard's commas).
const kubeletExtraArgsEnv = `BERTH_KUBELET_EXTRA_ARGS="eviction-hard=memory.available<100Mi,nodefs.available<1Gi,imagefs.available<1Gi",` +
	`image-gc-high-threshold=100,image-gc-low-threshold=99`
