package cli

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/mini"
)

// errNotRoot is returned by every mini command that changes the host when not run as root.
var errNotRoot = errors.New("berth mini needs root: it creates network namespaces, mounts, cgroups and daemons (run it with sudo)")

func newMiniCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "mini",
		Short: "Run a local Berth cluster whose nodes are namespaces on this machine",
		Long: `berth mini runs a real Kubernetes cluster on one Linux machine, without VMs.

Each node is a network namespace plus a private mount and UTS namespace with its own software TPM
(swtpm, EK certificate from a CA local to the cluster), containerd, cgroup subtree, kubelet and
Berth bootstrapper. A bridge in a separate namespace joins the nodes; the host reaches them through
one veth and serves them the metadata API. Node addresses come from a documentation range and no
namespace gets a default route, so nothing in the cluster can reach outside this machine.

Kubernetes, etcd, CoreDNS and flannel are built from their Go modules (scripts/build-k8s.sh, cached
by version), and every image is assembled locally and imported into each node: nothing is pulled.

Needs root, cgroup v1 or hybrid, and the Debian packages containerd, runc,
containernetworking-plugins, swtpm, swtpm-tools, nftables and iproute2 (scripts/install-deps.sh).

Progress (build, phases and their times) goes to stderr; what the cluster is and how to use it
goes to stdout.`,
		Example: `  sudo berth mini up --workers 2 --tampered-workers 1
  export KUBECONFIG=/var/lib/berth-mini/admin.conf; berth status
  sudo berth mini restart w1 --tamper-boot w1
  sudo berth mini add --workers 1
  sudo berth mini stop cp1
  sudo berth mini down`,
		Args: cobra.NoArgs,
		RunE: groupHelp,
	}
	cmd.AddCommand(newMiniUpCmd(), newMiniDownCmd(), newMiniRestartCmd(), newMiniStopCmd(), newMiniAddCmd(), newMiniAgentCmd())
	return cmd
}

// geteuid is os.Geteuid; tests replace it.
var geteuid = os.Geteuid

// requireRoot is the PreRunE of every mini command that changes the host: it fails unless berth runs
// as root.
func requireRoot(*cobra.Command, []string) error {
	if geteuid() != 0 {
		return &exitError{code: exitUsage, err: errNotRoot}
	}
	return nil
}

func miniLogger(w io.Writer) *zap.Logger {
	enc := zap.NewDevelopmentEncoderConfig()
	core := zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w), zapcore.InfoLevel)
	return zap.New(core)
}

// openMini opens the mini cluster in dir on this host, logging to errOut.
func openMini(dir string, errOut io.Writer) (*mini.Cluster, mini.Env, error) {
	env, err := mini.HostEnv()
	if err != nil {
		return nil, mini.Env{}, err
	}
	cl, err := mini.Open(dir, env, mini.Exec{}, miniLogger(errOut))
	return cl, env, err
}

// printNote prints what the cluster will lack, one line each.
func printNote(w io.Writer) func(string) {
	return func(s string) { _, _ = fmt.Fprintln(w, s) }
}

func printPhase(w io.Writer) func(mini.Phase) {
	return func(p mini.Phase) {
		_, _ = fmt.Fprintf(w, "  %-14s %6.2fs\n", p.Name, p.Duration.Seconds())
	}
}

type miniUpFlags struct {
	dir           string
	name          string
	subnet        string
	k8sVersion    string
	controlPlanes int
	workers       int
	tampered      int
	buildScript   string
	cacheDir      string
	bootstrapper  string
	attestation   string
	noBootstrap   bool
	noInit        bool
	readyTimeout  time.Duration
	clusterConfig string
}

func newMiniUpCmd() *cobra.Command {
	var f miniUpFlags
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Build (cached) and start a mini cluster",
		Long: `up builds the Kubernetes binaries and images (a no-op when cached), creates the nodes and starts
every node's swtpm, containerd and bootstrapper, then reports the time of every phase.

With --no-bootstrap it stops once every node has its TPM, containerd with all images imported and
its kubelet ready to be started; no bootstrapper runs and no Kubernetes cluster is formed.

If up fails half-way, what it created stays for inspection (logs under DIR/nodes/*/logs);
berth mini down removes it.

The first up builds Kubernetes, etcd, CoreDNS and flannel from source (scripts/build-k8s.sh,
about ten minutes on two cores; the build says what it builds and estimates how long is left);
later ones find them cached. --kubernetes-version picks another supported release (each is built
and cached once, with the etcd, CoreDNS and pause versions its kubeadm names).

With --config FILE, berth init's configuration starts from FILE (a config.berth.dev/v1alpha1
ClusterConfiguration: API-server flags, audit, kubelet and kube-proxy settings, ...); the mini
cluster sets the name, Kubernetes version, networks and policy files itself. A malformed FILE, or
one that sets the version or networks, is refused naming the field before anything is created.`,
		Example: `  sudo berth mini up
  sudo berth mini up --control-planes 3 --workers 2 --tampered-workers 1
  sudo berth mini up --attestation insecure-none --workers 1
  sudo berth mini up --kubernetes-version v1.36 --workers 1
  sudo berth mini up --config cluster.yaml   # a config.berth.dev/v1alpha1 ClusterConfiguration`,
		Args:    cobra.NoArgs,
		PreRunE: requireRoot,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runMiniUp(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dir, "dir", mini.DefaultDir, "directory for the cluster's state, node files, logs and admin.conf")
	fl.StringVar(&f.name, "name", mini.DefaultName, "cluster name; prefixes namespaces, links and cgroups (1-8 of [a-z0-9])")
	fl.StringVar(&f.subnet, "subnet", mini.DefaultSubnet, "node network (a documentation range); the host takes .1, nodes .10 and up")
	fl.StringVar(&f.k8sVersion, "kubernetes-version", k8sversion.Default().Kubernetes, "Kubernetes version or minor the cluster runs; supported: "+k8sversion.SupportedList())
	fl.IntVar(&f.controlPlanes, "control-planes", 1, "number of control-plane nodes")
	fl.IntVar(&f.workers, "workers", 2, "number of worker nodes")
	fl.IntVar(&f.tampered, "tampered-workers", 0, "extra workers t1..tK whose simulated boot is tampered with; an attested cluster must reject them")
	fl.StringVar(&f.buildScript, "build-script", "", "script that builds the upstream binaries and prints their bin dirs (default: scripts/build-k8s.sh of the checkout holding the berth binary, else of the current directory)")
	fl.StringVar(&f.cacheDir, "cache", envOr("BERTH_CACHE", "/var/cache/berth"), "build and image cache (also $BERTH_CACHE)")
	fl.StringVar(&f.bootstrapper, "bootstrapper", "", "bootstrapper binary (default: bootstrapper next to the berth binary)")
	fl.StringVar(&f.attestation, "attestation", mini.AttestationTPM, "attestation variant of the bootstrappers: tpm (swtpm per node, EK certificates from a mini-local CA) or insecure-none (development only)")
	fl.BoolVar(&f.noBootstrap, "no-bootstrap", false, "prepare the nodes but start no bootstrapper")
	fl.BoolVar(&f.noInit, "no-init", false, "start the nodes and their bootstrappers but do not initialize the cluster: up writes the policy and init config and prints the berth init command to run")
	fl.DurationVar(&f.readyTimeout, "ready-timeout", 10*time.Minute, "how long to wait for every node to be Ready after init")
	fl.StringVar(&f.clusterConfig, "config", "", "cluster configuration (config.berth.dev/v1alpha1 ClusterConfiguration) berth init's config starts from")
	return cmd
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func runMiniUp(ctx context.Context, out, errOut io.Writer, f miniUpFlags) error {
	subnet, err := netip.ParsePrefix(f.subnet)
	if err != nil {
		return &exitError{code: exitUsage, err: fmt.Errorf("parsing --subnet: %w", err)}
	}
	dir, err := filepath.Abs(f.dir)
	if err != nil {
		return fmt.Errorf("resolving --dir: %w", err)
	}
	release, err := k8sversion.Lookup(f.k8sVersion)
	if err != nil {
		return &exitError{code: exitUsage, err: fmt.Errorf("--kubernetes-version: %w", err)}
	}
	env, err := mini.HostEnv()
	if err != nil {
		return err
	}
	cfg := mini.Config{
		Name: f.name, Dir: dir, Subnet: subnet, KubernetesVersion: release.Kubernetes,
		PodCIDR:       netip.MustParsePrefix(mini.DefaultPodCIDR),
		ServiceCIDR:   netip.MustParsePrefix(mini.DefaultServiceCIDR),
		ControlPlanes: f.controlPlanes, Workers: f.workers, TamperedWorkers: f.tampered,
		Attestation: f.attestation,
	}
	if f.attestation != mini.AttestationTPM && f.attestation != mini.AttestationInsecureNone {
		return &exitError{code: exitUsage, err: fmt.Errorf("--attestation %q: want tpm or insecure-none", f.attestation)}
	}
	if err := cfg.Validate(); err != nil {
		return &exitError{code: exitUsage, err: err}
	}
	if f.clusterConfig != "" {
		if cfg.ClusterConfigFile, err = filepath.Abs(f.clusterConfig); err != nil {
			return fmt.Errorf("resolving --config: %w", err)
		}
		if _, err := mini.ReadClusterConfig(cfg.ClusterConfigFile); err != nil {
			return &exitError{code: exitUsage, err: err}
		}
	}
	if !f.noBootstrap {
		cfg.Bootstrapper = f.bootstrapper
		if cfg.Bootstrapper == "" {
			cfg.Bootstrapper = filepath.Join(filepath.Dir(env.Self), "bootstrapper")
		}
		if _, err := os.Stat(cfg.Bootstrapper); err != nil {
			return &exitError{code: exitUsage, err: fmt.Errorf("finding bootstrapper (build it with make build, or pass --no-bootstrap): %w", err)}
		}
	}
	start := time.Now()
	phase := printPhase(errOut)
	_, _ = fmt.Fprintf(errOut, "berth mini up: Kubernetes %s, %d control plane(s), %d worker(s) in %s\n", release.Kubernetes, cfg.ControlPlanes, cfg.Workers, dir)

	cleanup, err := mini.Build(ctx, &cfg, mini.BuildOptions{
		Script: f.buildScript, Cache: f.cacheDir, Self: env.Self, Berth: !f.noBootstrap,
		Log: errOut, Progress: phase, Note: printNote(errOut),
	})
	if err != nil {
		return err
	}
	defer cleanup()

	secret := make([]byte, 32)
	if _, err := rand.Read(secret); err != nil {
		return fmt.Errorf("creating init secret: %w", err)
	}
	log := miniLogger(errOut)
	cl := mini.New(cfg, env, mini.Exec{}, log)
	if _, err := cl.Up(ctx, mini.UpOptions{Progress: phase, InitSecret: secret}); err != nil {
		_, _ = fmt.Fprintf(errOut, "berth mini up failed; logs are under %s/nodes/*/logs; remove the cluster with: berth mini down --dir %s\n", dir, dir)
		return err
	}
	_, _ = fmt.Fprintf(errOut, "nodes up in %.1fs:", time.Since(start).Seconds())
	for _, n := range cfg.Nodes() {
		_, _ = fmt.Fprintf(errOut, " %s=%s", n.Name, n.IP)
	}
	_, _ = fmt.Fprintln(errOut)
	if f.noBootstrap {
		_, _ = fmt.Fprintf(out, "no bootstrapper started (--no-bootstrap). Run a command in a node with:\n  nsenter --net=/run/netns/%s --mount=%s --uts=%s -- CMD\n",
			cfg.NodeNetns(cfg.Nodes()[0].Name), cfg.MountNS(cfg.Nodes()[0].Name), cfg.UTSNS(cfg.Nodes()[0].Name))
		return nil
	}
	if f.noInit {
		args, err := cl.PrepareInit()
		if err != nil {
			return err
		}
		_, _ = fmt.Fprintf(out, "the nodes wait for berth init (--no-init). Initialize the cluster with:\n  %s %s\nthen wait for the nodes with:\n  kubectl --kubeconfig %s wait --for=condition=Ready nodes --all\n",
			env.Self, strings.Join(args, " "), filepath.Join(dir, "admin.conf"))
		return nil
	}
	status := func(s string) { _, _ = fmt.Fprintf(errOut, "    %s\n", strings.ReplaceAll(s, "\n", "\n    ")) }
	if _, err := cl.Bootstrap(ctx, mini.BootstrapOptions{Progress: phase, Status: status, ReadyTimeout: f.readyTimeout}); err != nil {
		_, _ = fmt.Fprintf(errOut, "berth mini up failed; logs are under %s/nodes/*/logs; remove the cluster with: berth mini down --dir %s\n", dir, dir)
		return err
	}
	report, err := cl.TamperedReport(ctx)
	if err != nil {
		return err
	}
	var joined []string
	for _, r := range report {
		if r.Joined {
			joined = append(joined, r.Node)
			_, _ = fmt.Fprintf(out, "  tampered %s: JOINED the cluster (attestation %s did not stop it)\n", r.Node, f.attestation)
			continue
		}
		_, _ = fmt.Fprintf(out, "  tampered %s: rejected: %s\n", r.Node, printable(r.Reason))
	}
	if len(joined) > 0 && f.attestation == mini.AttestationTPM {
		return fmt.Errorf("tampered nodes joined an attested cluster: %s", strings.Join(joined, " "))
	}
	_, _ = fmt.Fprintf(out, "cluster ready in %.1fs. Use it with:\n", time.Since(start).Seconds())
	for _, l := range useClusterLines(env.Self, cfg.Bins.K8s, cfg.AdminKubeconfig()) {
		_, _ = fmt.Fprintf(out, "  %s\n", l)
	}
	return nil
}

// lookPath is exec.LookPath; tests replace it.
var lookPath = exec.LookPath

// useClusterLines are the shell commands that use a new cluster as printed: the kubeconfig, a PATH
// with berth (self) and kubectl (from k8sBin) when the shell would not find these ones, then
// berth status and kubectl get nodes.
func useClusterLines(self, k8sBin, kubeconfig string) []string {
	lines := []string{"export KUBECONFIG=" + shellQuote(kubeconfig)}
	var path []string
	if p, err := lookPath("berth"); err != nil || !sameFile(p, self) {
		path = append(path, filepath.Dir(self))
	}
	if _, err := lookPath("kubectl"); err != nil && k8sBin != "" {
		path = append(path, k8sBin)
	}
	if len(path) > 0 {
		for i := range path {
			path[i] = shellQuote(path[i])
		}
		lines = append(lines, "export PATH="+strings.Join(path, ":")+":$PATH")
	}
	return append(lines, "berth status", "kubectl get nodes")
}

func sameFile(a, b string) bool {
	fa, errA := os.Stat(a)
	fb, errB := os.Stat(b)
	return errA == nil && errB == nil && os.SameFile(fa, fb)
}

// shellQuote quotes s for a POSIX shell when it holds anything but plain path characters.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+=,:@") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func newMiniDownCmd() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "down",
		Short: "Remove a mini cluster and everything it created",
		Long: `down stops every process of the cluster (the recorded daemons and everything in the nodes'
cgroups, containers included), unpins the nodes' namespaces, deletes the network namespaces and
links, the cgroups, the host mount points it created and the cluster directory. It works from the
state file, is idempotent, and also cleans up after a crashed up. Without a state file it does
nothing.`,
		Example: `  sudo berth mini down
  sudo berth mini down --dir /tmp/other-cluster`,
		Args:    cobra.NoArgs,
		PreRunE: requireRoot,
		RunE: func(cmd *cobra.Command, _ []string) error {
			out := cmd.OutOrStdout()
			cl, _, err := openMini(dir, cmd.ErrOrStderr())
			if errors.Is(err, mini.ErrNoState) {
				_, _ = fmt.Fprintf(out, "no mini cluster in %s; nothing to remove\n", dir)
				return nil
			}
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(cmd.ErrOrStderr(), "berth mini down: %s\n", dir)
			t, err := cl.Down(cmd.Context())
			for _, p := range t.Phases {
				printPhase(cmd.ErrOrStderr())(p)
			}
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(out, "removed in %.2fs\n", t.Total().Seconds())
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", mini.DefaultDir, "directory of the cluster")
	return cmd
}

type miniRestartFlags struct {
	dir          string
	readyTimeout time.Duration
	noWait       bool
	tamperBoot   []string
	genuineBoot  []string
	clearTPM     []string
	wipeDisk     []string
	bootstrapper bool
}

func newMiniRestartCmd() *cobra.Command {
	var f miniRestartFlags
	cmd := &cobra.Command{
		Use:   "restart [NODE...]",
		Short: "Power-cycle every node, or the named nodes, of a mini cluster at once",
		Long: `restart kills every process of the nodes at once (a power cut), recreates their network and
mount namespaces (so /run and all runtime mounts, the opened state disk included, are gone, as
after a reboot), makes sure no loop device still backs their state disks, and starts each node's
swtpm (PCRs reset, keys kept), containerd and bootstrapper again on the nodes' persistent
directories and state disks. Without NODE arguments every node is power-cycled; with them only
those, and the others keep running.

--tamper-boot makes a node's simulated boot measure a tampered image from this boot on (it stays
so across later restarts until --genuine-boot), so the key sealed to its TPM does not unseal and
the joinservice refuses it. --clear-tpm clears a node's TPM before its boot is measured: its sealed
keys die, its EK and EK certificate stay. --wipe-disk reinstalls a node: its state disk is blank
again and it joins as a fresh node, with the same TPM (the same machine to the joinservice).

--bootstrapper-only is no power cut but a crash of the node daemon: it kills only the bootstrapper
of the nodes with SIGKILL and starts it again; swtpm (with its PCRs), containerd, the namespaces and
the opened state disk stay. What the killed daemon started dies with it.

It prints the time of every phase, then waits until every restarted node whose boot is genuine
posts a Ready heartbeat after the power cut and prints the time from the power cut to then.
--no-wait skips that wait (a node that must be recovered never becomes Ready by itself).`,
		Example: `  berth mini restart                      # every node at once
  berth mini restart w2 --tamper-boot w2 --no-wait
  berth mini restart cp1 --clear-tpm cp1 --no-wait
  berth mini restart w1 --wipe-disk w1
  berth mini restart cp1 --bootstrapper-only --no-wait`,
		PreRunE: requireRoot,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runMiniRestart(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), args, f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dir, "dir", mini.DefaultDir, "directory of the cluster")
	fl.DurationVar(&f.readyTimeout, "ready-timeout", 10*time.Minute, "how long to wait for the restarted nodes to be Ready again")
	fl.BoolVar(&f.noWait, "no-wait", false, "do not wait for the restarted nodes to be Ready again")
	fl.StringSliceVar(&f.tamperBoot, "tamper-boot", nil, "NODE[,NODE]: from this boot on, measure the node's simulated boot as a tampered image (kept across restarts)")
	fl.StringSliceVar(&f.genuineBoot, "genuine-boot", nil, "NODE[,NODE]: measure the node's simulated boot as the genuine image again (undoes --tamper-boot)")
	fl.StringSliceVar(&f.clearTPM, "clear-tpm", nil, "NODE[,NODE]: clear the node's TPM (tpm2_clear) before its boot is measured; sealed keys die, the EK stays")
	fl.StringSliceVar(&f.wipeDisk, "wipe-disk", nil, "NODE[,NODE]: reinstall the node: its state disk is blank again, so it joins as a fresh node; its TPM and EK stay (the same machine)")
	fl.BoolVar(&f.bootstrapper, "bootstrapper-only", false, "kill only the nodes' bootstrapper (SIGKILL, a crash of the daemon) and start it again; no power cut")
	return cmd
}

func runMiniRestart(ctx context.Context, out, errOut io.Writer, names []string, f miniRestartFlags) error {
	cl, _, err := openMini(f.dir, errOut)
	if err != nil {
		return err
	}
	nodes, err := cl.RestartNodes(names)
	if err != nil {
		return &exitError{code: exitUsage, err: err}
	}
	_, _ = fmt.Fprintf(errOut, "berth mini restart: %s: %s\n", f.dir, strings.Join(nodeNames(nodes), " "))
	start := time.Now()
	if f.bootstrapper {
		if len(f.tamperBoot)+len(f.genuineBoot)+len(f.clearTPM)+len(f.wipeDisk) > 0 {
			return usageErr("--bootstrapper-only restarts no boot: it excludes --tamper-boot, --genuine-boot, --clear-tpm and --wipe-disk")
		}
		if err := cl.RestartBootstrappers(ctx, names); err != nil {
			return err
		}
		_, _ = fmt.Fprintf(errOut, "bootstrappers restarted in %.2fs\n", time.Since(start).Seconds())
		return waitRestarted(ctx, out, errOut, cl, nodes, start, f)
	}
	t, err := cl.Restart(ctx, mini.RestartOptions{Progress: printPhase(errOut), Nodes: names,
		TamperBoot: f.tamperBoot, GenuineBoot: f.genuineBoot, ClearTPM: f.clearTPM, WipeDisk: f.wipeDisk})
	if errors.Is(err, mini.ErrUnknownNode) || errors.Is(err, mini.ErrNotRestarted) {
		return &exitError{code: exitUsage, err: err}
	}
	if err != nil {
		return err
	}
	_, _ = fmt.Fprintf(errOut, "nodes restarted in %.2fs\n", t.Total().Seconds())
	for _, n := range f.clearTPM {
		_, _ = fmt.Fprintf(out, "  %s: TPM cleared before its boot was measured (sealed keys gone, EK kept)\n", n)
	}
	for _, n := range f.wipeDisk {
		_, _ = fmt.Fprintf(out, "  %s: reinstalled (blank state disk, same TPM): it joins as a fresh node\n", n)
	}
	// The nodes as they booted: with the boot each measured.
	if nodes, err = cl.RestartNodes(names); err != nil {
		return err
	}
	for _, n := range nodes {
		if n.Tampered {
			_, _ = fmt.Fprintf(out, "  %s: boot measured as a tampered image; not waiting for it to be Ready\n", n.Name)
		}
	}
	return waitRestarted(ctx, out, errOut, cl, nodes, start, f)
}

// waitRestarted waits until the restarted nodes are Ready again, unless told not to.
func waitRestarted(ctx context.Context, out, errOut io.Writer, cl *mini.Cluster, nodes []mini.Node, start time.Time, f miniRestartFlags) error {
	if f.noWait {
		_, _ = fmt.Fprintln(out, "not waiting for the nodes to be Ready (--no-wait)")
		return nil
	}
	if _, err := os.Stat(cl.Config().AdminKubeconfig()); err != nil {
		return nil // never bootstrapped (--no-bootstrap): nothing to wait for
	}
	t0 := time.Now()
	status := func(s string) { _, _ = fmt.Fprintf(errOut, "    %s\n", s) }
	if err := cl.WaitNodesReady(ctx, nodes, start, f.readyTimeout, status); err != nil {
		return err
	}
	printPhase(errOut)(mini.Phase{Name: "ready", Duration: time.Since(t0)})
	_, _ = fmt.Fprintf(out, "power cut -> all Ready: %.2fs\n", time.Since(start).Seconds())
	return nil
}

func nodeNames(nodes []mini.Node) []string {
	var names []string
	for _, n := range nodes {
		names = append(names, n.Name)
	}
	return names
}

func newMiniStopCmd() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "stop NODE...",
		Short: "Power off nodes of a mini cluster and leave them off",
		Long: `stop cuts the named nodes' power for good, like machines that died: every process of the node is
killed, its network and mount namespaces, cgroups and state disk loop device go. Its persistent
directories, TPM and state disk stay, and the agent still lists it in metadata (the machine
exists, it is just off). restart without node names leaves stopped nodes off; restart NODE powers
one on again. To take a stopped node out of the cluster, use berth node remove.

It prints the time of the power-off.`,
		Example: `  sudo berth mini stop cp1                  # the first control plane dies for good
  berth node remove cp1 --kubeconfig /var/lib/berth-mini/admin.conf
  sudo berth mini restart cp1               # or power it on again instead`,
		Args:    cobra.MinimumNArgs(1),
		PreRunE: requireRoot,
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, _, err := openMini(dir, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(cmd.ErrOrStderr(), "berth mini stop: %s: %s\n", dir, strings.Join(args, " "))
			t, err := cl.Stop(cmd.Context(), args, printPhase(cmd.ErrOrStderr()))
			if errors.Is(err, mini.ErrUnknownNode) {
				return &exitError{code: exitUsage, err: err}
			}
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(cmd.OutOrStdout(), "powered off %s in %.2fs; they stay off until berth mini restart NODE\n", strings.Join(args, " "), t.Total().Seconds())
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", mini.DefaultDir, "directory of the cluster")
	return cmd
}

type miniAddFlags struct {
	dir           string
	controlPlanes int
	workers       int
	readyTimeout  time.Duration
	noWait        bool
}

func newMiniAddCmd() *cobra.Command {
	var f miniAddFlags
	cmd := &cobra.Command{
		Use:   "add",
		Short: "Add nodes to a running mini cluster",
		Long: `add adds control planes and workers to a running mini cluster. The new nodes get the next names
(cpN, wN) and the next addresses after the existing ones and are recorded in the cluster's state
file, so the agent serves them their metadata (without a restart) and berth mini down removes them.
Each new node gets its network and namespaces, cgroups, a blank state disk, a TPM, containerd with
every image, and its bootstrapper, which joins the cluster through a joinservice by itself. The
other nodes keep running.

It prints the time of every phase, then waits until every new node is Ready (--no-wait skips it).
If add fails half-way, the nodes it recorded stay for inspection; berth mini down removes them.`,
		Example: `  berth mini add --workers 1
  berth mini add --control-planes 2 --workers 1`,
		Args:    cobra.NoArgs,
		PreRunE: requireRoot,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runMiniAdd(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.dir, "dir", mini.DefaultDir, "directory of the cluster")
	fl.IntVar(&f.controlPlanes, "control-planes", 0, "number of control-plane nodes to add")
	fl.IntVar(&f.workers, "workers", 0, "number of worker nodes to add")
	fl.DurationVar(&f.readyTimeout, "ready-timeout", 10*time.Minute, "how long to wait for the new nodes to be Ready")
	fl.BoolVar(&f.noWait, "no-wait", false, "do not wait for the new nodes to be Ready")
	return cmd
}

func runMiniAdd(ctx context.Context, out, errOut io.Writer, f miniAddFlags) error {
	if f.controlPlanes < 0 || f.workers < 0 || f.controlPlanes+f.workers == 0 {
		return &exitError{code: exitUsage, err: errors.New("add at least one node: --workers N and/or --control-planes M")}
	}
	cl, env, err := openMini(f.dir, errOut)
	if err != nil {
		return err
	}
	cfg := cl.Config()
	next := cfg.NextNodes(f.controlPlanes, f.workers)
	var names []string
	for _, n := range next {
		names = append(names, n.Name+"="+n.IP.String())
	}
	_, _ = fmt.Fprintf(errOut, "berth mini add: %s: %s\n", f.dir, strings.Join(names, " "))
	start := time.Now()
	var archive string
	if cfg.Bootstrapper != "" {
		a, cleanup, err := mini.WriteBerthArchive(cfg, env.Self, cfg.Dir, printNote(errOut))
		if err != nil {
			return err
		}
		defer cleanup()
		archive = a
		printPhase(errOut)(mini.Phase{Name: "image-archive", Duration: time.Since(start)})
	}
	added, t, err := cl.Add(ctx, mini.AddOptions{Progress: printPhase(errOut), ControlPlanes: f.controlPlanes, Workers: f.workers, BerthArchive: archive})
	if errors.Is(err, mini.ErrInvalidConfig) {
		return &exitError{code: exitUsage, err: err}
	}
	if err != nil {
		if len(added) > 0 {
			_, _ = fmt.Fprintf(errOut, "berth mini add failed; logs are under %s/nodes/*/logs; berth mini down --dir %s removes the cluster with the added nodes\n", f.dir, f.dir)
		}
		return err
	}
	_, _ = fmt.Fprintf(errOut, "nodes added in %.2fs\n", t.Total().Seconds())
	if f.noWait || cfg.Bootstrapper == "" {
		return nil
	}
	if _, err := os.Stat(cfg.AdminKubeconfig()); err != nil {
		return nil // never bootstrapped: nothing to join
	}
	t0 := time.Now()
	status := func(s string) { _, _ = fmt.Fprintf(errOut, "    %s\n", s) }
	if err := cl.WaitNodesReady(ctx, added, time.Time{}, f.readyTimeout, status); err != nil {
		return err
	}
	printPhase(errOut)(mini.Phase{Name: "ready", Duration: time.Since(t0)})
	_, _ = fmt.Fprintf(out, "added -> all Ready: %.2fs\n", time.Since(start).Seconds())
	return nil
}

func newMiniAgentCmd() *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:     "agent",
		Short:   "Host daemon of a mini cluster (started by up): metadata API and CNI configs",
		Example: `  berth mini agent --dir /var/lib/berth-mini   # berth mini up starts it; it runs until SIGTERM`,
		Hidden:  true,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			return mini.RunAgent(ctx, dir, miniLogger(cmd.ErrOrStderr()))
		},
	}
	cmd.Flags().StringVar(&dir, "dir", mini.DefaultDir, "directory of the cluster")
	return cmd
}
