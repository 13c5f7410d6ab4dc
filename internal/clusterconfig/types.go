package clusterconfig

import (
	"k8s.io/apimachinery/pkg/runtime"
	auditv1 "k8s.io/apiserver/pkg/apis/audit/v1"
	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
)

// The comments on the types and fields of this file are the reference documentation: `make
// clusterconfig-docs` turns them into REFERENCE.md and the JSON schema. Each field's comment starts
// with its JSON name.

// ClusterConfiguration is the cluster configuration the operator owns: what `berth init --config`
// reads, and what the cluster keeps in force in the ConfigMap kube-system/berth-cluster-config.
type ClusterConfiguration struct {
	// apiVersion is config.berth.dev/v1alpha1.
	APIVersion string `json:"apiVersion"`
	// kind is ClusterConfiguration.
	Kind string `json:"kind"`
	// clusterName names the cluster in kubeconfig files and kubeadm; a DNS label. Default: berth.
	ClusterName string `json:"clusterName,omitempty"`
	// kubernetesVersion is the exact Kubernetes version kubeadm deploys, vMAJOR.MINOR.PATCH; the
	// node's kubeadm must be this version. Default: Berth's default version.
	KubernetesVersion string `json:"kubernetesVersion,omitempty"`
	// networking holds the cluster's pod and service ranges.
	Networking Networking `json:"networking,omitempty"`
	// apiServer configures kube-apiserver: extra flags and volumes, certificate names, audit,
	// OIDC and admission.
	APIServer APIServer `json:"apiServer,omitempty"`
	// controllerManager configures kube-controller-manager's extra flags and volumes.
	ControllerManager ControlPlaneComponent `json:"controllerManager,omitempty"`
	// scheduler configures kube-scheduler's extra flags and volumes.
	Scheduler ControlPlaneComponent `json:"scheduler,omitempty"`
	// featureGates are Kubernetes feature gates (name: enabled), given to the API server,
	// controller manager, scheduler, every kubelet and kube-proxy. Each name must be a gate that
	// kubernetesVersion knows (the gates of the Kubernetes release Berth is built with, from the
	// minor that introduced each one).
	FeatureGates map[string]bool `json:"featureGates,omitempty"`
	// patches are kubeadm patches applied to every control plane's static pod manifests and
	// kubelet configuration after Berth generated them: `berth init` writes them on the first
	// control plane, and every control plane that joins later gets them in its join ticket.
	Patches []Patch `json:"patches,omitempty"`
	// kubelet is every node's kubelet configuration, in the kubelet's own
	// kubelet.config.k8s.io/v1beta1 KubeletConfiguration (without apiVersion and kind). Berth sets
	// cgroupDriver and keeps certificate rotation and serving-certificate bootstrap on.
	Kubelet *kubeletv1beta1.KubeletConfiguration `json:"kubelet,omitempty"`
	// kubeProxy is kube-proxy's configuration, in kube-proxy's own kubeproxy.config.k8s.io/v1alpha1
	// KubeProxyConfiguration (without apiVersion and kind). An empty mode leaves the node's default.
	KubeProxy *kubeproxyv1alpha1.KubeProxyConfiguration `json:"kubeProxy,omitempty"`
	// components selects the optional components Berth installs.
	Components Components `json:"components,omitempty"`
	// policies names the policy files `berth init` reads, relative to this file's directory.
	Policies Policies `json:"policies,omitempty"`
	// initSecretFile names the file holding the first control plane's init secret (hex), relative
	// to this file's directory. `berth init` needs it; the cluster never stores the secret.
	InitSecretFile string `json:"initSecretFile,omitempty"`
	// InitSecret is the init secret (hex) an unversioned config held inline. The versioned form
	// has no such field: the secret is never encoded, so neither the cluster nor `berth config
	// show` ever holds it.
	InitSecret string `json:"-"`
}

// Networking is the cluster's address ranges.
type Networking struct {
	// serviceSubnet is the services' range (CIDR). Default: 10.96.0.0/12.
	ServiceSubnet string `json:"serviceSubnet,omitempty"`
	// podSubnet is the pods' range (CIDR). Default: 10.244.0.0/16.
	PodSubnet string `json:"podSubnet,omitempty"`
}

// ControlPlaneComponent is what the operator adds to a control-plane component's static pod.
type ControlPlaneComponent struct {
	// extraArgs are extra command-line flags, in order; a flag Berth sets itself is refused.
	ExtraArgs []Arg `json:"extraArgs,omitempty"`
	// extraVolumes are extra host paths mounted into the component's pod.
	ExtraVolumes []HostPathMount `json:"extraVolumes,omitempty"`
}

// Arg is one command-line flag.
type Arg struct {
	// name is the flag's name without the leading dashes.
	Name string `json:"name"`
	// value is the flag's value.
	Value string `json:"value"`
}

// HostPathMount is a host path mounted into a control-plane pod.
type HostPathMount struct {
	// name names the volume in the pod; a DNS label.
	Name string `json:"name"`
	// hostPath is the absolute path on the node.
	HostPath string `json:"hostPath"`
	// mountPath is the absolute path in the container.
	MountPath string `json:"mountPath"`
	// readOnly mounts the path read-only.
	ReadOnly bool `json:"readOnly,omitempty"`
	// pathType is the host path's type: "", DirectoryOrCreate, Directory, FileOrCreate, File,
	// Socket, CharDevice or BlockDevice.
	PathType string `json:"pathType,omitempty"`
}

// APIServer configures kube-apiserver.
type APIServer struct {
	ControlPlaneComponent `json:",inline"`
	// certSANs are extra subject alternative names (IP addresses or DNS names) of the API server's
	// certificate.
	CertSANs []string `json:"certSANs,omitempty"`
	// audit turns on the API server's audit log.
	Audit *Audit `json:"audit,omitempty"`
	// oidc makes the API server accept tokens of an OpenID Connect issuer.
	OIDC *OIDC `json:"oidc,omitempty"`
	// admission adds admission plugins and their settings to Berth's own.
	Admission Admission `json:"admission,omitempty"`
}

// Audit is the API server's audit log, written to a file on each control plane. `berth init`
// writes the policy file on the first control plane; every control plane that joins later gets it
// in its join ticket and writes it at the same path, before its API server starts.
type Audit struct {
	// policy is the audit policy, an audit.k8s.io/v1 Policy (without apiVersion and kind).
	Policy auditv1.Policy `json:"policy"`
	// logPath is the absolute path of the audit log on the control plane; its directory is mounted
	// into the API server's pod. Default: /var/log/kubernetes/audit/audit.log (on the state disk).
	LogPath string `json:"logPath,omitempty"`
	// maxAge is how many days rotated logs are kept; 0 keeps them by maxBackups only.
	MaxAge int32 `json:"maxAge,omitempty"`
	// maxBackups is how many rotated logs are kept. Default: 10.
	MaxBackups int32 `json:"maxBackups,omitempty"`
	// maxSize is the size in megabytes at which the log is rotated. Default: 100.
	MaxSize int32 `json:"maxSize,omitempty"`
}

// OIDC is an OpenID Connect issuer whose ID tokens the API server accepts.
type OIDC struct {
	// issuerURL is the issuer's https URL.
	IssuerURL string `json:"issuerURL"`
	// clientID is the audience the tokens must carry.
	ClientID string `json:"clientID"`
	// usernameClaim is the claim that names the user. Default: sub.
	UsernameClaim string `json:"usernameClaim,omitempty"`
	// usernamePrefix is put before every user name; "-" for none.
	UsernamePrefix string `json:"usernamePrefix,omitempty"`
	// groupsClaim is the claim that lists the user's groups.
	GroupsClaim string `json:"groupsClaim,omitempty"`
	// groupsPrefix is put before every group name.
	GroupsPrefix string `json:"groupsPrefix,omitempty"`
	// caFile is the absolute path on the control plane of the CA bundle that signs the issuer's
	// certificate; empty uses the host's roots.
	CAFile string `json:"caFile,omitempty"`
	// requiredClaims are claims (name: value) every token must carry.
	RequiredClaims map[string]string `json:"requiredClaims,omitempty"`
}

// Admission is what the operator adds to Berth's admission chain. Berth always runs PodSecurity
// with its own configuration, NodeRestriction and the validating admission policies and webhooks
// that guard berth-system; none of them can be disabled or reconfigured.
type Admission struct {
	// enablePlugins are admission plugins enabled besides the API server's defaults.
	EnablePlugins []string `json:"enablePlugins,omitempty"`
	// disablePlugins are default admission plugins turned off; Berth's own are refused.
	DisablePlugins []string `json:"disablePlugins,omitempty"`
	// plugins are admission plugins' configurations, merged after Berth's PodSecurity into the
	// admission configuration file of every control plane (control planes that join later get the
	// file in their join ticket); PodSecurity's is Berth's and refused here.
	Plugins []AdmissionPlugin `json:"plugins,omitempty"`
}

// AdmissionPlugin is one plugin's configuration.
type AdmissionPlugin struct {
	// name is the plugin's name, e.g. EventRateLimit.
	Name string `json:"name"`
	// configuration is the plugin's configuration object, as the plugin reads it.
	Configuration runtime.RawExtension `json:"configuration"`
}

// Patch is one kubeadm patch.
type Patch struct {
	// target is what the patch changes: kube-apiserver, kube-controller-manager, kube-scheduler,
	// etcd or kubeletconfiguration.
	Target string `json:"target"`
	// type is the patch's format: strategic (default), merge or json.
	Type string `json:"type,omitempty"`
	// patch is the patch itself, YAML or JSON.
	Patch string `json:"patch"`
}

// Components selects the optional components Berth installs.
type Components struct {
	// skipKubeProxy leaves kube-proxy out.
	SkipKubeProxy bool `json:"skipKubeProxy,omitempty"`
	// skipCoreDNS leaves CoreDNS out.
	SkipCoreDNS bool `json:"skipCoreDNS,omitempty"`
}

// Policies are the policy files the configuration refers to, by path.
type Policies struct {
	// attestationPolicyFile names the measurement (attestation) policy that `berth init` checks
	// the first node against and the joinservice enforces on joining nodes.
	AttestationPolicyFile string `json:"attestationPolicyFile,omitempty"`
	// imagePolicyFile names the image-policy webhook's policy; empty uses the default policy.
	ImagePolicyFile string `json:"imagePolicyFile,omitempty"`
	// joinPolicyFile names the join policy joining nodes check the joinservice against; `berth
	// init` writes it, with the cluster's attestation-key CA added, to the workspace.
	JoinPolicyFile string `json:"joinPolicyFile,omitempty"`
}
