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
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	bootstraptokenv1 "k8s.io/kubernetes/cmd/kubeadm/app/apis/bootstraptoken/v1"
	"k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/v1beta4"
	"sigs.k8s.io/yaml"
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
	failFalse := false
	rotate := true
	kubeletCfg := kubeletv1beta1.KubeletConfiguration{
		TypeMeta:     metav1.TypeMeta{APIVersion: kubeletv1beta1.SchemeGroupVersion.String(), Kind: "KubeletConfiguration"},
		CgroupDriver: cgroupDriver,
		FailSwapOn:   &failFalse,
		FailCgroupV1: &failFalse,
		// The kubelet renews its client certificate itself (kube-controller-manager approves a node's
		// renewal for its own name, by kubeadm's RBAC) and asks for its serving certificate with a CSR
		// for signer kubernetes.io/kubelet-serving instead of signing one itself; the joinservice's
		// certificate keeper approves it for the node that asks (joinservice/certkeeper). Every
		// node's kubelet gets this configuration (kubeadm keeps it in ConfigMap kubelet-config).
		RotateCertificates: rotate,
		ServerTLSBootstrap: rotate,
	}
	docs := []any{initCfg, clusterCfg, kubeletCfg}
	if p.KubeProxyMode != "" || p.KubeProxyConntrackMaxPerCore != nil {
		proxy := map[string]any{
			"apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
			"kind":       "KubeProxyConfiguration",
		}
		if p.KubeProxyMode != "" {
			proxy["mode"] = p.KubeProxyMode
		}
		if p.KubeProxyConntrackMaxPerCore != nil {
			proxy["conntrack"] = map[string]any{"maxPerCore": *p.KubeProxyConntrackMaxPerCore}
		}
		docs = append(docs, proxy)
	}
	return joinDocs(docs)
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
	return joinDocs([]any{cfg})
}

func joinDocs(docs []any) ([]byte, error) {
	var buf bytes.Buffer
	for i, d := range docs {
		out, err := yaml.Marshal(d)
		if err != nil {
			return nil, fmt.Errorf("marshalling kubeadm configuration: %w", err)
		}
		if i > 0 {
			buf.WriteString("---\n")
		}
		buf.Write(out)
	}
	return buf.Bytes(), nil
}
