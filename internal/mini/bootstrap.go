package mini

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/kubeclient"
)

// Attestation variants the mini cluster can ask its bootstrappers for.
const (
	AttestationTPM          = "tpm"
	AttestationInsecureNone = "insecure-none"
)

// BootstrapOptions tune Bootstrap.
type BootstrapOptions struct {
	Progress func(Phase)
	// ReadyTimeout bounds the wait for every node to be Ready (default 10 minutes).
	ReadyTimeout time.Duration
	// Status, when set, is called with a one-line summary while waiting for nodes.
	Status func(string)
}

// ErrNotReady is returned when nodes did not become Ready in time.
var ErrNotReady = errors.New("nodes not ready")

// initConfig is `berth init`'s cluster config file for the mini cluster, in the versioned form
// internal/clusterconfig owns: the operator's (Config.ClusterConfigFile, `berth mini up --config`)
// with what the mini cluster decides set over it (name, version, networks, the init secret and
// policy files). The API servers' certificates name the control-plane endpoint (kubeadm adds it
// too).
func (c *Cluster) initConfig() ([]byte, error) {
	cfg := clusterconfig.Default()
	if c.cfg.ClusterConfigFile != "" {
		var err error
		if cfg, err = ReadClusterConfig(c.cfg.ClusterConfigFile); err != nil {
			return nil, err
		}
	}
	cfg.ClusterName = c.cfg.Name
	cfg.KubernetesVersion = c.cfg.Release().Kubernetes
	cfg.Networking = clusterconfig.Networking{ServiceSubnet: c.cfg.ServiceCIDR.Masked().String(), PodSubnet: c.cfg.PodCIDR.Masked().String()}
	cfg.APIServer.CertSANs = append(cfg.APIServer.CertSANs, c.cfg.HostAddr().String())
	cfg.InitSecretFile = c.initSecretPath()
	cfg.Policies = clusterconfig.Policies{}
	if c.cfg.Attestation == AttestationTPM {
		cfg.Policies.AttestationPolicyFile = c.cfg.PolicyPath()
		cfg.Policies.JoinPolicyFile = c.cfg.ImageJoinPolicyPath()
	}
	data, err := clusterconfig.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	return append([]byte("# Written by berth mini.\n"), data...), nil
}

// ErrClusterConfig wraps a refusal of the operator's cluster configuration.
var ErrClusterConfig = errors.New("the cluster configuration")

// ReadClusterConfig reads the operator's cluster configuration for a mini cluster, strictly and
// validated: `berth mini up --config` refuses a bad one before it creates anything. The mini
// cluster chooses the name, Kubernetes version, networks and policy files itself; a file that
// sets a version or networks other than the mini cluster's is refused, naming the field.
func ReadClusterConfig(path string) (clusterconfig.ClusterConfiguration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return clusterconfig.ClusterConfiguration{}, fmt.Errorf("%w: %w", ErrClusterConfig, err)
	}
	cfg, _, err := clusterconfig.Decode(data)
	if err != nil {
		return cfg, fmt.Errorf("%w %s: %w", ErrClusterConfig, path, err)
	}
	if cfg.KubernetesVersion != "" {
		return cfg, fmt.Errorf("%w %s: kubernetesVersion: the mini cluster runs the version --kubernetes-version names (%s)", ErrClusterConfig, path, k8sversion.SupportedList())
	}
	if cfg.Networking != (clusterconfig.Networking{}) {
		return cfg, fmt.Errorf("%w %s: networking: the mini cluster chooses its own networks", ErrClusterConfig, path)
	}
	clusterconfig.SetDefaults(&cfg)
	if errs := clusterconfig.Validate(&cfg); len(errs) > 0 {
		return cfg, fmt.Errorf("%w %s: %w", ErrClusterConfig, path, errs.ToAggregate())
	}
	return cfg, nil
}

func (c *Cluster) initSecretPath() string { return filepath.Join(c.cfg.Dir, "init-secret") }

// PrepareInit writes the attestation policy, the image's join policy and `berth init`'s config
// file into the cluster directory and returns the arguments of the `berth init` command that
// initializes the cluster through the first control plane (without the berth binary itself). berth
// init writes the cluster's join policy (JoinPolicyPath) into the same directory.
func (c *Cluster) PrepareInit() ([]string, error) {
	if err := writeFile(c.cfg.PolicyPath(), c.policyFile(), 0o644); err != nil {
		return nil, err
	}
	if err := writeFile(c.cfg.ImageJoinPolicyPath(), c.joinPolicyFile(), 0o644); err != nil {
		return nil, err
	}
	cfgPath := filepath.Join(c.cfg.Dir, "init.yaml")
	initCfg, err := c.initConfig()
	if err != nil {
		return nil, err
	}
	if err := writeFile(cfgPath, initCfg, 0o600); err != nil {
		return nil, err
	}
	cp := c.cfg.Nodes()[0]
	args := []string{"init", "--endpoint", netip.AddrPortFrom(cp.IP, InitPort).String(), "--config", cfgPath,
		"--workspace", c.cfg.Dir, "--connect-timeout", "2m"}
	if c.cfg.Attestation == AttestationInsecureNone {
		args = append(args, "--insecure-skip-attestation")
	}
	return args, nil
}

// Bootstrap initializes the cluster through the first control plane's InitServer with `berth init`
// (the same command an operator runs) and waits until every node joined by itself and is Ready.
func (c *Cluster) Bootstrap(ctx context.Context, opts BootstrapOptions) (Timings, error) {
	var t Timings
	err := t.run("init", opts.Progress, func() error {
		args, err := c.PrepareInit()
		if err != nil {
			return err
		}
		out, err := c.run.Run(ctx, Cmd{Path: c.env.Self, Args: args})
		if err != nil {
			return fmt.Errorf("berth init: %w", err)
		}
		if opts.Status != nil {
			opts.Status(strings.TrimSpace(string(out)))
		}
		return nil
	})
	if err != nil {
		return t, err
	}
	err = t.run("ready", opts.Progress, func() error { return c.WaitReady(ctx, time.Time{}, opts.ReadyTimeout, opts.Status) })
	return t, err
}

// WaitReady waits until every node of the cluster whose boot is genuine is registered and Ready,
// through the admin kubeconfig berth init wrote (default timeout 10 minutes).
//
// Only a Ready condition posted at or after since counts (zero since accepts any), so that after a
// restart a node's status from before the power cut is not mistaken for a fresh one.
func (c *Cluster) WaitReady(ctx context.Context, since time.Time, timeout time.Duration, status func(string)) error {
	return c.WaitNodesReady(ctx, c.cfg.GenuineNodes(), since, timeout, status)
}

// WaitNodesReady is WaitReady for the given nodes only; nodes whose boot is tampered, and stopped
// nodes, are skipped, as they never become Ready.
func (c *Cluster) WaitNodesReady(ctx context.Context, nodes []Node, since time.Time, timeout time.Duration, status func(string)) error {
	if timeout == 0 {
		timeout = 10 * time.Minute
	}
	var want []Node
	for _, n := range nodes {
		if !n.Tampered && !n.Stopped {
			want = append(want, n)
		}
	}
	if len(want) == 0 {
		return nil
	}
	cs, err := newClientset(c.cfg.AdminKubeconfig())
	if err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return waitNodesReady(wctx, cs.CoreV1().Nodes(), want, since, status)
}

// nodeClient lists the cluster's Node objects.
type nodeClient interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.NodeList, error)
}

func newClientset(kubeconfig string) (kubernetes.Interface, error) {
	rc, err := kubeclient.FromFile(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", kubeconfig, err)
	}
	rc.Timeout = 10 * time.Second
	return kubeclient.Clientset(rc)
}

// waitNodesReady polls until every node in want is registered and Ready.
func waitNodesReady(ctx context.Context, client nodeClient, want []Node, since time.Time, status func(string)) error {
	last := ""
	var missing []string
	err := wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
		list, err := client.List(ctx, metav1.ListOptions{})
		if err != nil {
			missing = []string{"(API: " + err.Error() + ")"}
			return false, nil
		}
		missing = notReady(list.Items, want, since)
		if s := strings.Join(missing, " "); s != last && status != nil {
			status("waiting for nodes: " + s)
			last = s
		}
		return len(missing) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("%w: %s: %w", ErrNotReady, strings.Join(missing, " "), err)
	}
	return nil
}

// notReady returns "name(reason)" for every wanted node that is missing or not Ready (since).
func notReady(items []corev1.Node, want []Node, since time.Time) []string {
	byName := map[string]corev1.Node{}
	for _, n := range items {
		byName[n.Name] = n
	}
	var out []string
	for _, w := range want {
		n, ok := byName[w.Name]
		if !ok {
			out = append(out, w.Name+"(not registered)")
			continue
		}
		ready := false
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue && !cond.LastHeartbeatTime.Time.Before(since.Truncate(time.Second)) {
				ready = true
			}
		}
		if !ready {
			out = append(out, w.Name+"(not ready)")
		}
	}
	sort.Strings(out)
	return out
}

// writeInitSecret stores the init secret (hex) for berth init; only root can read it.
func (c *Cluster) writeInitSecret(secret []byte) error {
	if len(secret) == 0 {
		return nil
	}
	return writeFile(c.initSecretPath(), []byte(hex.EncodeToString(secret)+"\n"), 0o600)
}

// TamperedStatus describes what happened to one tampered node.
type TamperedStatus struct {
	Node string
	// Joined is true when the node is registered in the cluster: attestation did not stop it.
	Joined bool
	// Reason is the last rejection or error the node's bootstrapper logged.
	Reason string
}

// TamperedReport tells, for every tampered node, whether it got into the cluster and why not.
func (c *Cluster) TamperedReport(ctx context.Context) ([]TamperedStatus, error) {
	var tampered []Node
	for _, n := range c.cfg.Nodes() {
		if n.Tampered {
			tampered = append(tampered, n)
		}
	}
	if len(tampered) == 0 {
		return nil, nil
	}
	cs, err := newClientset(c.cfg.AdminKubeconfig())
	if err != nil {
		return nil, err
	}
	list, err := cs.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("listing nodes: %w", err)
	}
	registered := map[string]bool{}
	for _, n := range list.Items {
		registered[n.Name] = true
	}
	var out []TamperedStatus
	for _, n := range tampered {
		out = append(out, TamperedStatus{Node: n.Name, Joined: registered[n.Name],
			Reason: lastRejection(filepath.Join(c.logDir(n.Name), "bootstrapper.log"))})
	}
	return out, nil
}

// lastRejection returns the last log line of a bootstrapper that mentions a rejection or an error.
func lastRejection(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		l := strings.ToLower(lines[i])
		if strings.Contains(l, "reject") || strings.Contains(l, `"level":"error"`) || strings.Contains(l, `"level":"warn"`) {
			return strings.TrimSpace(lines[i])
		}
	}
	return ""
}
