// Package kubeadm generates kubeadm's configuration from its v1beta4 API types and runs the kubeadm
// binary phase by phase through an injected command runner.
package kubeadm

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	bootstraptokenv1 "k8s.io/kubernetes/cmd/kubeadm/app/apis/bootstraptoken/v1"
	"k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/v1beta4"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/clusterconfig"
)

// NodeParams describe the node kubeadm configures, for init and join alike.
type NodeParams struct {
	// Name is the Kubernetes node name.
	Name string
	// IP is the node's address in the cluster network (advertise address, kubelet node-ip).
	IP string
	// CRISocket is the container runtime's endpoint, e.g. "unix:///run/containerd/containerd.sock".
	CRISocket string
	// Worker removes the default control-plane taint (a nil taint list means "default" to kubeadm).
	Untainted bool
	// KubeletExtraArgs are extra kubelet flags (name → value) that kubeadm writes to kubeadm-flags.env.
	KubeletExtraArgs [][2]string
	// NeverPull tells kubeadm never to pull images (every image is pre-imported).
	NeverPull bool
}

// InitParams describe a new cluster.
type InitParams struct {
	Node NodeParams
	// ControlPlaneEndpoint is HOST:PORT of the API server as every node and the operator reach it.
	ControlPlaneEndpoint string
	ClusterName          string
	KubernetesVersion    string
	ServiceCIDR          string
	PodCIDR              string
	CertSANs             []string
	// CgroupDriver is "systemd" or "cgroupfs".
	CgroupDriver string
	// KubeProxyMode is kube-proxy's mode ("nftables", "iptables"); empty leaves kubeadm's default.
	KubeProxyMode string
	// KubeProxyConntrackMaxPerCore, when set, is kube-proxy's conntrack.maxPerCore; 0 leaves the
	// host's nf_conntrack_max alone (needed where nodes share a kernel, as namespace nodes do).
	KubeProxyConntrackMaxPerCore *int32
	// Encryption, when set, makes the API server encrypt at rest as its EncryptionConfiguration says.
	// It goes into the ClusterConfiguration, which kubeadm uploads: every control plane that joins
	// later gets the same flag and mounts, so its files must be in the same places.
	Encryption *Encryption
	// AdmissionConfigFile, when set, is the absolute path of the API server's admission configuration
	// (--admission-control-config-file); its directory is mounted read-only into the API server's
	// static pod. The setting is part of the cluster configuration, so control planes that join later
	// get it too: the file must be at the same path on every control plane before kubeadm runs.
	AdmissionConfigFile string
	// Cluster, when set, is the operator's configuration (clusterconfig.Validate passed): its
	// components' flags and volumes, feature gates, OIDC, audit log, admission plugins, patches,
	// kubelet and kube-proxy configuration go into kubeadm's. Its name, version and networks are
	// the fields above.
	Cluster *clusterconfig.ClusterConfiguration
	// AuditPolicyFile is the absolute path where the node wrote Cluster's audit policy; required
	// when Cluster has one. Its directory is mounted read-only into the API server's pod.
	AuditPolicyFile string
	// PatchesDir is the absolute path of the directory holding Cluster's patches as kubeadm reads
	// them (PatchFiles); required when Cluster has patches.
	PatchesDir string
}

// Encryption is where a control plane keeps what the API server needs to encrypt at rest.
type Encryption struct {
	// ConfigFile is the EncryptionConfiguration (--encryption-provider-config); its directory is
	// mounted read-only into the API server's pod.
	ConfigFile string
	// SocketDir holds the KMS plugin's socket; it is mounted into the API server's pod.
	SocketDir string
}

func (e *Encryption) validate() error {
	for name, p := range map[string]string{"encryption configuration": e.ConfigFile, "KMS socket directory": e.SocketDir} {
		if !filepath.IsAbs(p) {
			return invalid("%s %q is not an absolute path", name, p)
		}
	}
	return nil
}

// apiServer adds the API server's encryption flag and mounts to c.
func (e *Encryption) apiServer(c *v1beta4.ControlPlaneComponent) {
	c.ExtraArgs = append(c.ExtraArgs, v1beta4.Arg{Name: "encryption-provider-config", Value: e.ConfigFile})
	dirOrCreate := corev1.HostPathDirectoryOrCreate
	c.ExtraVolumes = append(c.ExtraVolumes,
		v1beta4.HostPathMount{Name: "berth-encryption-config", HostPath: filepath.Dir(e.ConfigFile), MountPath: filepath.Dir(e.ConfigFile), ReadOnly: true, PathType: dirOrCreate},
		v1beta4.HostPathMount{Name: "berth-kms-socket", HostPath: e.SocketDir, MountPath: e.SocketDir, PathType: dirOrCreate},
	)
}

// ErrInvalidParams wraps every validation failure of the parameters.
var ErrInvalidParams = errors.New("invalid kubeadm parameters")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidParams, fmt.Sprintf(format, args...))
}

func (p NodeParams) validate() error {
	if p.Name == "" {
		return invalid("node name is empty")
	}
	if net.ParseIP(p.IP) == nil {
		return invalid("node IP %q is not an IP address", p.IP)
	}
	if p.CRISocket == "" {
		return invalid("CRI socket is empty")
	}
	return nil
}

func (p NodeParams) registration() v1beta4.NodeRegistrationOptions {
	reg := v1beta4.NodeRegistrationOptions{
		Name:             p.Name,
		CRISocket:        p.CRISocket,
		KubeletExtraArgs: []v1beta4.Arg{{Name: "node-ip", Value: p.IP}},
	}
	for _, a := range p.KubeletExtraArgs {
		reg.KubeletExtraArgs = append(reg.KubeletExtraArgs, v1beta4.Arg{Name: a[0], Value: a[1]})
	}
	if p.Untainted {
		reg.Taints = []corev1.Taint{}
	}
	if p.NeverPull {
		reg.ImagePullPolicy = corev1.PullNever
	}
	return reg
}

// InitConfig renders the multi-document kubeadm configuration for `kubeadm init`.
func InitConfig(p InitParams) ([]byte, error) {
	if err := p.Node.validate(); err != nil {
		return nil, err
	}
	host, port, err := net.SplitHostPort(p.ControlPlaneEndpoint)
	if err != nil || host == "" {
		return nil, invalid("control-plane endpoint %q is not HOST:PORT", p.ControlPlaneEndpoint)
	}
	bindPort, err := strconv.ParseInt(port, 10, 32)
	if err != nil || bindPort <= 0 || bindPort > 65535 {
		return nil, invalid("control-plane endpoint %q has an invalid port", p.ControlPlaneEndpoint)
	}
	for name, cidr := range map[string]string{"service": p.ServiceCIDR, "pod": p.PodCIDR} {
		if _, _, err := net.ParseCIDR(cidr); err != nil {
			return nil, invalid("%s CIDR %q is not a CIDR", name, cidr)
		}
	}
	if p.KubernetesVersion == "" {
		return nil, invalid("Kubernetes version is empty")
	}
	if p.Encryption != nil {
		if err := p.Encryption.validate(); err != nil {
			return nil, err
		}
	}
	cgroupDriver := p.CgroupDriver
	if cgroupDriver == "" {
		cgroupDriver = "systemd"
	}
	if cgroupDriver != "systemd" && cgroupDriver != "cgroupfs" {
		return nil, invalid("cgroup driver %q is neither systemd nor cgroupfs", cgroupDriver)
	}

	initCfg := v1beta4.InitConfiguration{
		TypeMeta:         metav1.TypeMeta{APIVersion: v1beta4.SchemeGroupVersion.String(), Kind: "InitConfiguration"},
		NodeRegistration: p.Node.registration(),
		LocalAPIEndpoint: v1beta4.APIEndpoint{AdvertiseAddress: p.Node.IP, BindPort: int32(bindPort)},
		// kubeadm always creates a bootstrap token (24 h by default). Berth's joins never use one
		// (workers and control planes join with the ticket's certificate), so it expires at once
		// instead of lingering as a credential that can mint any node's client certificate.
		BootstrapTokens: []bootstraptokenv1.BootstrapToken{{
			Description: "kubeadm init's token; Berth joins without bootstrap tokens",
			TTL:         &metav1.Duration{Duration: time.Minute},
		}},
	}
	if p.AdmissionConfigFile != "" && !filepath.IsAbs(p.AdmissionConfigFile) {
		return nil, invalid("admission configuration %q is not an absolute path", p.AdmissionConfigFile)
	}
	clusterCfg := v1beta4.ClusterConfiguration{
		TypeMeta:             metav1.TypeMeta{APIVersion: v1beta4.SchemeGroupVersion.String(), Kind: "ClusterConfiguration"},
		ClusterName:          p.ClusterName,
		KubernetesVersion:    p.KubernetesVersion,
		ControlPlaneEndpoint: p.ControlPlaneEndpoint,
		// ECDSA P-256 keys for the cluster CA and every certificate kubeadm makes: the joinservice
		// signs a kubelet certificate per join, and an RSA-2048 signature is about 0.8 ms of CPU
		// (make bench-join: about 2,000 joins/s on 2 cores with RSA, 7,500/s with ECDSA P-256).
		EncryptionAlgorithm: v1beta4.EncryptionAlgorithmECDSAP256,
		Networking:          v1beta4.Networking{ServiceSubnet: p.ServiceCIDR, PodSubnet: p.PodCIDR},
		APIServer: v1beta4.APIServer{
			CertSANs: p.CertSANs,
			// Webhooks and aggregated APIs are dialled at an endpoint IP, so admission keeps working
			// even when Service routing (kube-proxy) is down.
			ControlPlaneComponent: v1beta4.ControlPlaneComponent{ExtraArgs: []v1beta4.Arg{{Name: "enable-aggregator-routing", Value: "true"}}},
		},
	}
	if p.Encryption != nil {
		p.Encryption.apiServer(&clusterCfg.APIServer.ControlPlaneComponent)
	}
	if p.AdmissionConfigFile != "" {
		dir := filepath.Dir(p.AdmissionConfigFile)
		api := &clusterCfg.APIServer.ControlPlaneComponent
		api.ExtraArgs = append(api.ExtraArgs, v1beta4.Arg{Name: "admission-control-config-file", Value: p.AdmissionConfigFile})
		// The encryption configuration may live in the same directory: a pod mounts a path once.
		if !slices.ContainsFunc(api.ExtraVolumes, func(v v1beta4.HostPathMount) bool { return v.MountPath == dir }) {
			api.ExtraVolumes = append(api.ExtraVolumes, v1beta4.HostPathMount{
				Name: "berth-admission", HostPath: dir, MountPath: dir, ReadOnly: true, PathType: corev1.HostPathDirectory,
			})
		}
	}
	var operator clusterconfig.ClusterConfiguration
	if p.Cluster != nil {
		operator = *p.Cluster
		if err := applyOperator(&initCfg, &clusterCfg, p); err != nil {
			return nil, err
		}
	}
	failFalse := false
	kubeletCfg := operator.KubeletConfiguration()
	kubeletCfg.CgroupDriver = cgroupDriver
	if kubeletCfg.FailSwapOn == nil {
		kubeletCfg.FailSwapOn = &failFalse
	}
	if kubeletCfg.FailCgroupV1 == nil {
		kubeletCfg.FailCgroupV1 = &failFalse
	}
	// The kubelet renews its client certificate itself (kube-controller-manager approves a node's
	// renewal for its own name, by kubeadm's RBAC) and asks for its serving certificate with a CSR
	// for signer kubernetes.io/kubelet-serving instead of signing one itself; the joinservice's
	// certificate keeper approves it for the node that asks (joinservice/certkeeper). Every
	// node's kubelet gets this configuration (kubeadm keeps it in ConfigMap kubelet-config).
	kubeletCfg.RotateCertificates = true
	kubeletCfg.ServerTLSBootstrap = true
	kubeletDoc, err := clusterconfig.CompactYAML(kubeletCfg)
	if err != nil {
		return nil, err
	}
	docs := []any{initCfg, clusterCfg, kubeletDoc}
	proxy := operator.KubeProxyConfiguration()
	if proxy == nil && (p.KubeProxyMode != "" || p.KubeProxyConntrackMaxPerCore != nil) {
		proxy = &kubeproxyv1alpha1.KubeProxyConfiguration{TypeMeta: metav1.TypeMeta{APIVersion: "kubeproxy.config.k8s.io/v1alpha1", Kind: "KubeProxyConfiguration"}}
	}
	if proxy != nil {
		// The operator's mode wins over the node's default; the node's conntrack setting (nodes
		// that share a kernel) over kube-proxy's default.
		if proxy.Mode == "" {
			proxy.Mode = kubeproxyv1alpha1.ProxyMode(p.KubeProxyMode)
		}
		if proxy.Conntrack.MaxPerCore == nil {
			proxy.Conntrack.MaxPerCore = p.KubeProxyConntrackMaxPerCore
		}
		proxyDoc, err := clusterconfig.CompactYAML(proxy)
		if err != nil {
			return nil, err
		}
		docs = append(docs, proxyDoc)
	}
	return joinDocs(docs)
}

// applyOperator puts the operator's configuration into kubeadm's.
func applyOperator(initCfg *v1beta4.InitConfiguration, c *v1beta4.ClusterConfiguration, p InitParams) error {
	o := p.Cluster
	gates := featureGates(o.FeatureGates)
	api := &c.APIServer.ControlPlaneComponent
	addComponent(api, o.APIServer.ControlPlaneComponent, gates)
	addComponent(&c.ControllerManager, o.ControllerManager, gates)
	addComponent(&c.Scheduler, o.Scheduler, gates)
	c.APIServer.CertSANs = slices.Compact(slices.Concat(c.APIServer.CertSANs, o.APIServer.CertSANs))
	if a := o.APIServer.Audit; a != nil {
		if !filepath.IsAbs(p.AuditPolicyFile) {
			return invalid("audit policy file %q is not an absolute path", p.AuditPolicyFile)
		}
		api.ExtraArgs = append(api.ExtraArgs,
			v1beta4.Arg{Name: "audit-policy-file", Value: p.AuditPolicyFile},
			v1beta4.Arg{Name: "audit-log-path", Value: a.LogPath},
			v1beta4.Arg{Name: "audit-log-maxage", Value: strconv.Itoa(int(a.MaxAge))},
			v1beta4.Arg{Name: "audit-log-maxbackup", Value: strconv.Itoa(int(a.MaxBackups))},
			v1beta4.Arg{Name: "audit-log-maxsize", Value: strconv.Itoa(int(a.MaxSize))},
		)
		mount(api, "berth-audit-policy", filepath.Dir(p.AuditPolicyFile), true, corev1.HostPathDirectory)
		mount(api, "berth-audit-log", filepath.Dir(a.LogPath), false, corev1.HostPathDirectoryOrCreate)
	}
	if oidc := o.APIServer.OIDC; oidc != nil {
		for _, a := range [][2]string{
			{"oidc-issuer-url", oidc.IssuerURL}, {"oidc-client-id", oidc.ClientID}, {"oidc-username-claim", oidc.UsernameClaim},
			{"oidc-username-prefix", oidc.UsernamePrefix}, {"oidc-groups-claim", oidc.GroupsClaim}, {"oidc-groups-prefix", oidc.GroupsPrefix},
			{"oidc-ca-file", oidc.CAFile},
		} {
			if a[1] != "" {
				api.ExtraArgs = append(api.ExtraArgs, v1beta4.Arg{Name: a[0], Value: a[1]})
			}
		}
		claims := make([]string, 0, len(oidc.RequiredClaims))
		for k, v := range oidc.RequiredClaims {
			claims = append(claims, k+"="+v)
		}
		slices.Sort(claims)
		for _, claim := range claims {
			api.ExtraArgs = append(api.ExtraArgs, v1beta4.Arg{Name: "oidc-required-claim", Value: claim})
		}
		if oidc.CAFile != "" {
			mount(api, "berth-oidc-ca", filepath.Dir(oidc.CAFile), true, corev1.HostPathDirectory)
		}
	}
	// NodeRestriction is kubeadm's default; naming the plugins replaces the default list.
	if adm := o.APIServer.Admission; len(adm.EnablePlugins) > 0 || len(adm.DisablePlugins) > 0 {
		api.ExtraArgs = append(api.ExtraArgs, v1beta4.Arg{Name: "enable-admission-plugins", Value: strings.Join(slices.Concat([]string{"NodeRestriction"}, adm.EnablePlugins), ",")})
		if len(adm.DisablePlugins) > 0 {
			api.ExtraArgs = append(api.ExtraArgs, v1beta4.Arg{Name: "disable-admission-plugins", Value: strings.Join(adm.DisablePlugins, ",")})
		}
	}
	if len(o.Patches) > 0 {
		if !filepath.IsAbs(p.PatchesDir) {
			return invalid("patches directory %q is not an absolute path", p.PatchesDir)
		}
		initCfg.Patches = &v1beta4.Patches{Directory: p.PatchesDir}
	}
	return nil
}

// featureGates renders feature gates as the components' --feature-gates value, sorted; "" for none.
func featureGates(gates map[string]bool) string {
	parts := make([]string, 0, len(gates))
	for name, on := range gates {
		parts = append(parts, name+"="+strconv.FormatBool(on))
	}
	slices.Sort(parts)
	return strings.Join(parts, ",")
}

// addComponent adds the operator's flags, volumes and feature gates to a component.
func addComponent(c *v1beta4.ControlPlaneComponent, o clusterconfig.ControlPlaneComponent, gates string) {
	if gates != "" {
		c.ExtraArgs = append(c.ExtraArgs, v1beta4.Arg{Name: "feature-gates", Value: gates})
	}
	for _, a := range o.ExtraArgs {
		c.ExtraArgs = append(c.ExtraArgs, v1beta4.Arg{Name: a.Name, Value: a.Value})
	}
	for _, v := range o.ExtraVolumes {
		c.ExtraVolumes = append(c.ExtraVolumes, v1beta4.HostPathMount{
			Name: v.Name, HostPath: v.HostPath, MountPath: v.MountPath, ReadOnly: v.ReadOnly, PathType: corev1.HostPathType(v.PathType),
		})
	}
}

// mount mounts dir into c's pod at the same path unless the pod mounts that path already.
func mount(c *v1beta4.ControlPlaneComponent, name, dir string, readOnly bool, pathType corev1.HostPathType) {
	if slices.ContainsFunc(c.ExtraVolumes, func(v v1beta4.HostPathMount) bool { return v.MountPath == dir }) {
		return
	}
	c.ExtraVolumes = append(c.ExtraVolumes, v1beta4.HostPathMount{Name: name, HostPath: dir, MountPath: dir, ReadOnly: readOnly, PathType: pathType})
}

// PatchFiles returns the files of a patches directory for kubeadm (name: content) holding the
// configuration's patches in order: "<target><index>+<type>.yaml".
func PatchFiles(patches []clusterconfig.Patch) map[string][]byte {
	files := make(map[string][]byte, len(patches))
	for i, p := range patches {
		files[fmt.Sprintf("%s%03d+%s.yaml", p.Target, i, p.Type)] = []byte(p.Patch)
	}
	return files
}

// JoinParams describe how a node joins an existing cluster. It joins either with a bootstrap token
// (Token and CACertHashes: token discovery, the token also authenticates the TLS bootstrap) or with
// a discovery file (DiscoveryFile: a kubeconfig that pins the cluster CA and carries the node's own
// client credentials, so no bootstrap token exists at all).
type JoinParams struct {
	Node NodeParams
	// APIServerEndpoint is HOST:PORT of the cluster's API server.
	APIServerEndpoint string
	// Token is the bootstrap token; empty with DiscoveryFile.
	Token string
	// CACertHashes pin the cluster CA ("sha256:<hex>") for token discovery.
	CACertHashes []string
	// DiscoveryFile is the path of a kubeconfig holding the cluster CA, the API server and the
	// credentials kubeadm uses for the TLS bootstrap; empty with Token.
	DiscoveryFile string
	// ControlPlane, when set, joins the node as a control plane advertising its IP on this port.
	ControlPlane bool
	BindPort     int32
	// PatchesDir, when set, is the absolute path of the directory holding the cluster
	// configuration's patches (PatchFiles), as the first control plane had them.
	PatchesDir string
}

// JoinConfig renders the kubeadm configuration for `kubeadm join`.
func JoinConfig(p JoinParams) ([]byte, error) {
	if err := p.Node.validate(); err != nil {
		return nil, err
	}
	if _, _, err := net.SplitHostPort(p.APIServerEndpoint); err != nil {
		return nil, invalid("API server endpoint %q is not HOST:PORT", p.APIServerEndpoint)
	}
	var discovery v1beta4.Discovery
	switch {
	case p.Token != "" && p.DiscoveryFile != "":
		return nil, invalid("both a bootstrap token and a discovery file: give one")
	case p.DiscoveryFile != "":
		if !filepath.IsAbs(p.DiscoveryFile) {
			return nil, invalid("discovery file %q is not an absolute path", p.DiscoveryFile)
		}
		discovery.File = &v1beta4.FileDiscovery{KubeConfigPath: p.DiscoveryFile}
	case p.Token == "":
		return nil, invalid("neither a bootstrap token nor a discovery file")
	case len(p.CACertHashes) == 0:
		return nil, invalid("no CA certificate hash: refusing to join without pinning the cluster CA")
	default:
		discovery.BootstrapToken = &v1beta4.BootstrapTokenDiscovery{
			Token:             p.Token,
			APIServerEndpoint: p.APIServerEndpoint,
			CACertHashes:      p.CACertHashes,
		}
		discovery.TLSBootstrapToken = p.Token
	}
	cfg := v1beta4.JoinConfiguration{
		TypeMeta:         metav1.TypeMeta{APIVersion: v1beta4.SchemeGroupVersion.String(), Kind: "JoinConfiguration"},
		NodeRegistration: p.Node.registration(),
		Discovery:        discovery,
	}
	if p.ControlPlane {
		port := p.BindPort
		if port == 0 {
			port = 6443
		}
		cfg.ControlPlane = &v1beta4.JoinControlPlane{LocalAPIEndpoint: v1beta4.APIEndpoint{AdvertiseAddress: p.Node.IP, BindPort: port}}
	}
	if p.PatchesDir != "" {
		if !filepath.IsAbs(p.PatchesDir) {
			return nil, invalid("patches directory %q is not an absolute path", p.PatchesDir)
		}
		cfg.Patches = &v1beta4.Patches{Directory: p.PatchesDir}
	}
	return joinDocs([]any{cfg})
}

// joinDocs joins documents into one multi-document YAML; a []byte is a document already encoded.
func joinDocs(docs []any) ([]byte, error) {
	var buf bytes.Buffer
	for i, d := range docs {
		out, ok := d.([]byte)
		if !ok {
			var err error
			if out, err = yaml.Marshal(d); err != nil {
				return nil, fmt.Errorf("marshalling kubeadm configuration: %w", err)
			}
		}
		if i > 0 {
			buf.WriteString("---\n")
		}
		buf.Write(out)
	}
	return buf.Bytes(), nil
}
