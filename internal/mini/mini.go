// Package mini builds and removes Berth's mini cluster: Kubernetes "nodes" on one Linux host, each
// a network namespace plus a private mount and UTS namespace with its own swtpm (EK certificate from
// a mini-local CA), containerd, cgroup subtree and bootstrapper, joined by a bridge that lives in a
// switch namespace. The host reaches the nodes through one veth on that bridge and serves them the
// mini metadata API. Addresses come from a documentation range; no namespace gets a default route.
//
// What a node's cluster components write lives on its encrypted state disk, as on a machine: the
// bootstrapper binds /etc/kubernetes, the kubelet's, etcd's and its own directories from it, and the
// node's state-dirs script (stateDirsScript) binds containerd's root, the CNI state and /var/log once
// the disk is open; containerd and the kubelet start only then. Until then those paths are read-only
// placeholders.
//
// Every side effect goes through Runner (commands and detached daemons) or through plain files under
// the cluster directory and the cgroup and netns roots named in Env, so the logic is unit-testable
// with a recording Runner and temporary roots. What Up creates is recorded in the cluster's state
// file before and after it is created, and Down removes it, idempotently, also after a crash.
package mini

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/metadata"
	"github.com/berth-k8s/berth/internal/statedisk"
)

// Image references of the mini cluster's own images. The upstream ones (registry.k8s.io) follow the
// cluster's Kubernetes release (Config.Release, k8sversion.Release.Images); the berth.local ones are
// ours and never resolve anywhere, so a missing import fails fast.
const (
	ImageFlannel = "berth.local/flannel:v0.28.4"
	ImageTestApp = "berth.local/testapp:v1"
	// ImageJoinService is the bootstrapper's default joinservice image.
	ImageJoinService = "berth.local/joinservice:dev"
	// ImageWebhook is the image-policy webhook's image when the cluster carries it.
	ImageWebhook = "berth.local/berth-webhook:dev"
)

// Network defaults. Pod and service ranges exist only inside the node namespaces.
const (
	DefaultSubnet      = "198.51.100.0/24"
	DefaultPodCIDR     = "10.244.0.0/16"
	DefaultServiceCIDR = "10.96.0.0/12"
	DefaultName        = "mini"
	// DefaultDir lies outside every directory a node mounts its own over (see Config.Validate):
	// the nodes read their kubelet wrapper, policies and state disk from it by host path.
	DefaultDir = "/var/lib/berth-mini"
	// MetadataPort is the port of the metadata API on the host's address in the cluster subnet.
	MetadataPort = 8099
	// TPMPort is swtpm's data port on each node's own loopback; the control port is TPMPort+1.
	TPMPort = 2321
	// InitPort is the bootstrapper's InitServer port on every node.
	InitPort = 9000
	// CRISocket is containerd's socket inside every node.
	CRISocket = "unix:///run/containerd/containerd.sock"
	// RecoveryPort is the port of the recovery server a node whose state disk stays locked runs.
	RecoveryPort = 9001
	// DefaultStateDiskSize is the size of every node's (sparse) state disk image. The disk holds the
	// node's images too (about 0.7 GiB), and the kubelet evicts pods when its file system has less
	// than 1 GiB free (kubeletExtraArgsEnv).
	DefaultStateDiskSize = 8 << 30
	// StateDiskBackend is the state disk backend the bootstrappers use: the mini's kernel has no
	// device-mapper, so ext4 native encryption on a loop-mounted image.
	StateDiskBackend = "fscrypt"
	// StateDiskMount is where a node's bootstrapper mounts its state disk (on the node's /run).
	StateDiskMount = "/run/berth/state-disk"
	// NodeStateDir is the bootstrapper's state directory inside a node, as on the OS image; the
	// bootstrapper binds it from the state disk.
	NodeStateDir = "/var/lib/berth"
	// StateDiskRoot is the opened state disk's plaintext tree inside a node (the fscrypt backend's
	// encrypted directory under StateDiskMount); the bootstrapper binds its directories, and the
	// node's state-dirs script binds containerd's root, the CNI state and /var/log from it.
	StateDiskRoot = StateDiskMount + "/" + statedisk.DataDir
)

// ErrInvalidConfig is returned by Config.Validate.
var ErrInvalidConfig = errors.New("invalid mini cluster configuration")

// Bins locates the binaries scripts/build-k8s.sh built (one bin dir per component).
type Bins struct {
	K8s     string `json:"k8s"`
	Etcd    string `json:"etcd"`
	CoreDNS string `json:"coredns"`
	Flannel string `json:"flannel"`
	PodBin  string `json:"podbin"`
}

// Config describes one mini cluster.
type Config struct {
	// Name prefixes every namespace, link and cgroup; 1-8 of [a-z0-9], starting with a letter.
	Name string `json:"name"`
	// Dir holds the cluster's state, node directories, logs and admin.conf.
	Dir string `json:"dir"`
	// KubernetesVersion is the exact Kubernetes version the cluster runs, one of k8sversion's
	// supported releases; "" is the default release (and what a state file written before the field
	// existed reads as).
	KubernetesVersion string `json:"kubernetesVersion,omitempty"`
	// Subnet is the node network; the host takes the first address, nodes start at .10.
	Subnet        netip.Prefix `json:"subnet"`
	PodCIDR       netip.Prefix `json:"podCIDR"`
	ServiceCIDR   netip.Prefix `json:"serviceCIDR"`
	ControlPlanes int          `json:"controlPlanes"`
	Workers       int          `json:"workers"`
	// TamperedWorkers are extra workers t1..tK whose simulated boot measures something else, so an
	// attesting cluster must reject them.
	TamperedWorkers int  `json:"tamperedWorkers,omitempty"`
	Bins            Bins `json:"bins"`
	// Bootstrapper is the bootstrapper binary each node runs; empty means none is started.
	Bootstrapper string `json:"bootstrapper,omitempty"`
	// ImageArchive is the docker-archive tar of the upstream images imported into every node.
	ImageArchive string `json:"imageArchive"`
	// GoldenRoot is a containerd root holding the upstream images (EnsureGoldenRoot); nodes start
	// from a copy of it. Without it, ImageArchive is imported into each node instead.
	GoldenRoot string `json:"goldenRoot,omitempty"`
	// BerthArchive is the docker-archive tar of Berth's own images (joinservice); optional.
	BerthArchive string `json:"berthArchive,omitempty"`
	// WebhookImage, when set, makes the first control plane install the image-policy webhook with
	// this image (which BerthArchive must hold).
	WebhookImage string `json:"webhookImage,omitempty"`
	// Attestation is the variant the bootstrappers use (AttestationTPM or AttestationInsecureNone).
	Attestation string `json:"attestation,omitempty"`
	// StateDiskSize is the size of each node's state disk image in bytes (0: DefaultStateDiskSize).
	StateDiskSize int64 `json:"stateDiskSize,omitempty"`
	// Added are the nodes `berth mini add` added after up, with their addresses, in order.
	Added []Node `json:"added,omitempty"`
	// BootTampered overrides, by node name, whether a node's simulated boot measures a tampered
	// image (`berth mini restart --tamper-boot` / `--genuine-boot`); it applies from the node's next boot.
	BootTampered map[string]bool `json:"bootTampered,omitempty"`
	// Stopped names the nodes `berth mini stop` powered off; they stay off until `berth mini restart
	// NODE` powers them on again.
	Stopped map[string]bool `json:"stopped,omitempty"`
	// ClusterConfigFile is the operator's cluster configuration (`berth mini up --config`), which
	// berth init's config starts from; empty for Berth's defaults.
	ClusterConfigFile string `json:"clusterConfigFile,omitempty"`
}

var nameRE = regexp.MustCompile(`^[a-z][a-z0-9]{0,7}$`)

// Validate reports the first problem with c.
func (c Config) Validate() error {
	switch {
	case !nameRE.MatchString(c.Name):
		return fmt.Errorf("%w: name %q must be 1-8 of [a-z0-9] starting with a letter", ErrInvalidConfig, c.Name)
	case !filepath.IsAbs(c.Dir):
		return fmt.Errorf("%w: dir %q is not absolute", ErrInvalidConfig, c.Dir)
	case !c.Subnet.IsValid() || !c.Subnet.Addr().Is4() || c.Subnet.Bits() > 26:
		return fmt.Errorf("%w: subnet %v must be an IPv4 prefix of /26 or larger", ErrInvalidConfig, c.Subnet)
	case !c.PodCIDR.IsValid() || !c.ServiceCIDR.IsValid():
		return fmt.Errorf("%w: pod and service CIDRs are required", ErrInvalidConfig)
	case c.ControlPlanes < 1 || c.ControlPlanes > 9:
		return fmt.Errorf("%w: control planes must be 1..9, got %d", ErrInvalidConfig, c.ControlPlanes)
	case c.Workers < 0 || c.Workers > 40:
		return fmt.Errorf("%w: workers must be 0..40, got %d", ErrInvalidConfig, c.Workers)
	case c.TamperedWorkers < 0 || c.TamperedWorkers > 9:
		return fmt.Errorf("%w: tampered workers must be 0..9, got %d", ErrInvalidConfig, c.TamperedWorkers)
	case c.StateDiskSize < 0:
		return fmt.Errorf("%w: state disk size %d is negative", ErrInvalidConfig, c.StateDiskSize)
	}
	if r, err := k8sversion.Lookup(c.KubernetesVersion); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	} else if c.KubernetesVersion != "" && c.KubernetesVersion != r.Kubernetes {
		return fmt.Errorf("%w: kubernetes version %q must be exact (%s)", ErrInvalidConfig, c.KubernetesVersion, r.Kubernetes)
	}
	for _, m := range nodeMounts {
		if rel, err := filepath.Rel(m.dst, c.Dir); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return fmt.Errorf("%w: dir %s lies in %s, which every node mounts its own over: the nodes would not see it (choose another --dir)", ErrInvalidConfig, c.Dir, m.dst)
		}
	}
	seen := map[string]bool{}
	for _, n := range c.Nodes() {
		if seen[n.Name] {
			return fmt.Errorf("%w: node name %s is used twice", ErrInvalidConfig, n.Name)
		}
		seen[n.Name] = true
		if !c.fits(n.IP) {
			return fmt.Errorf("%w: node %s's address %s is outside subnet %s", ErrInvalidConfig, n.Name, n.IP, c.Subnet.Masked())
		}
	}
	return nil
}

// Release is the Kubernetes release the cluster runs: the one KubernetesVersion names, else the
// default. Validate refuses a version that names none.
func (c Config) Release() k8sversion.Release {
	r, err := k8sversion.Lookup(c.KubernetesVersion)
	if err != nil {
		return k8sversion.Default()
	}
	return r
}

// fits reports whether ip is a usable node address of the subnet (inside it, not its broadcast).
func (c Config) fits(ip netip.Addr) bool {
	return c.Subnet.Contains(ip) && c.Subnet.Contains(ip.Next())
}

// Node is one namespace node of the cluster.
type Node struct {
	// Name is the node's instance and Kubernetes node name.
	Name string        `json:"name"`
	Role metadata.Role `json:"role"`
	IP   netip.Addr    `json:"ip"`
	// Tampered nodes measure a different boot into their TPM.
	Tampered bool `json:"tampered,omitempty"`
	// Stopped nodes are powered off (Config.Stopped).
	Stopped bool `json:"stopped,omitempty"`
}

// Nodes lists the cluster's nodes: control planes cp1..cpM first, then workers w1..wN. Node i
// (from 0) gets the subnet's address .10+i.
func (c Config) Nodes() []Node {
	var nodes []Node
	ip := c.Subnet.Masked().Addr()
	for range 10 {
		ip = ip.Next()
	}
	for i := 1; i <= c.ControlPlanes; i++ {
		nodes = append(nodes, Node{Name: fmt.Sprintf("cp%d", i), Role: metadata.RoleControlPlane, IP: ip})
		ip = ip.Next()
	}
	for i := 1; i <= c.Workers; i++ {
		nodes = append(nodes, Node{Name: fmt.Sprintf("w%d", i), Role: metadata.RoleWorker, IP: ip})
		ip = ip.Next()
	}
	for i := 1; i <= c.TamperedWorkers; i++ {
		nodes = append(nodes, Node{Name: fmt.Sprintf("t%d", i), Role: metadata.RoleWorker, IP: ip, Tampered: true})
		ip = ip.Next()
	}
	nodes = append(nodes, c.Added...)
	for i := range nodes {
		if t, ok := c.BootTampered[nodes[i].Name]; ok {
			nodes[i].Tampered = t
		}
		nodes[i].Stopped = c.Stopped[nodes[i].Name]
	}
	return nodes
}

// Node returns the node called name.
func (c Config) Node(name string) (Node, bool) {
	for _, n := range c.Nodes() {
		if n.Name == name {
			return n, true
		}
	}
	return Node{}, false
}

// GenuineNodes are the running nodes whose boot is not tampered: the ones that must become Ready.
func (c Config) GenuineNodes() []Node {
	var out []Node
	for _, n := range c.Nodes() {
		if !n.Tampered && !n.Stopped {
			out = append(out, n)
		}
	}
	return out
}

// HostAddr is the host's address on the cluster bridge; the metadata API listens there.
func (c Config) HostAddr() netip.Addr { return c.Subnet.Masked().Addr().Next() }

// HostPrefix is HostAddr with the subnet's length.
func (c Config) HostPrefix() netip.Prefix { return netip.PrefixFrom(c.HostAddr(), c.Subnet.Bits()) }

// MetadataURL is the base URL of the metadata API as nodes reach it.
func (c Config) MetadataURL() string {
	return fmt.Sprintf("http://%s", netip.AddrPortFrom(c.HostAddr(), MetadataPort))
}

// SwitchNetns is the name of the namespace holding the bridge.
func (c Config) SwitchNetns() string { return "berth-" + c.Name + "-sw" }

// NodeNetns is the name of a node's network namespace.
func (c Config) NodeNetns(node string) string { return "berth-" + c.Name + "-" + node }

// HostLink is the host end of the veth into the switch.
func (c Config) HostLink() string { return c.Name + "-host" }

// CgroupPath is a node's cgroup, relative to each hierarchy's root; kubelet gets it as cgroup root.
func (c Config) CgroupPath(node string) string { return "/berth/" + c.Name + "/" + node }

// ClusterCgroup is the parent of every node cgroup of the cluster.
func (c Config) ClusterCgroup() string { return "/berth/" + c.Name }

// NodeDir is the host directory holding everything of one node.
func (c Config) NodeDir(node string) string { return filepath.Join(c.Dir, "nodes", node) }

// StateDisk is the host path of a node's state disk: a sparse image file, blank until the node's
// bootstrapper formats it, kept across restarts like a machine's disk.
func (c Config) StateDisk(node string) string { return filepath.Join(c.NodeDir(node), "state.img") }

// StateDiskBytes is the size of every node's state disk image.
func (c Config) StateDiskBytes() int64 {
	if c.StateDiskSize == 0 {
		return DefaultStateDiskSize
	}
	return c.StateDiskSize
}

// NSDir holds the files that pin the nodes' mount and UTS namespaces.
func (c Config) NSDir() string { return filepath.Join(c.Dir, "ns") }

// MountNS is the file pinning a node's mount namespace.
func (c Config) MountNS(node string) string { return filepath.Join(c.NSDir(), node+".mnt") }

// UTSNS is the file pinning a node's UTS namespace.
func (c Config) UTSNS(node string) string { return filepath.Join(c.NSDir(), node+".uts") }

// TPMCADir holds the mini-local CA that signs every node's EK certificate.
func (c Config) TPMCADir() string { return filepath.Join(c.Dir, "tpm-ca") }

// TPMCARoot is the PEM root certificate of the EK CA; verifiers trust it.
func (c Config) TPMCARoot() string {
	return filepath.Join(c.TPMCADir(), "swtpm-localca-rootca-cert.pem")
}

// TPMCAIntermediate is the PEM certificate that signs the EK certificates (issued by the root).
func (c Config) TPMCAIntermediate() string { return filepath.Join(c.TPMCADir(), "issuercert.pem") }

// AdminKubeconfig is where up writes the cluster's admin kubeconfig.
func (c Config) AdminKubeconfig() string { return filepath.Join(c.Dir, "admin.conf") }

// SeedDir holds the cluster's seed containerd root (SeedDir/root): every image of the cluster,
// imported once on the host. A node whose state disk holds no containerd root yet copies it there
// (public images only; nothing a node runs or writes is in it).
func (c Config) SeedDir() string { return filepath.Join(c.Dir, "containerd-seed") }

// ComponentsDir holds the manifests the first control plane applies after kubeadm init.
func (c Config) ComponentsDir() string { return filepath.Join(c.Dir, "components") }

// PolicyPath is the attestation policy berth init uses (and sends to the cluster).
func (c Config) PolicyPath() string { return filepath.Join(c.Dir, "policy.yaml") }

// JoinPolicyPath is the cluster's join policy, which berth init writes into its workspace (the
// cluster directory): the image's join policy with the cluster's attestation-key CA. Nodes started
// after init check the joinservice against it.
func (c Config) JoinPolicyPath() string { return filepath.Join(c.Dir, "join-policy.yaml") }

// ImageJoinPolicyPath is the join policy the nodes' image carries (the same boot, a set lock
// register, the mini-local EK CA): what a node started before the cluster exists checks the
// joinservice against. It lists no attestation-key CA, so the joinservice's TPM proves its key to
// such a node in the handshake.
func (c Config) ImageJoinPolicyPath() string { return filepath.Join(c.Dir, "image-join-policy.yaml") }

// StatePath is the cluster's state file.
func (c Config) StatePath() string { return filepath.Join(c.Dir, "state.json") }
