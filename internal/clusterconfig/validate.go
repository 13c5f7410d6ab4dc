package clusterconfig

import (
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	auditv1 "k8s.io/apiserver/pkg/apis/audit/v1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/k8sversion"
)

var (
	kubeVersion = regexp.MustCompile(`^v1\.[0-9]+\.[0-9]+$`)
	featureGate = regexp.MustCompile(`^[A-Z][A-Za-z0-9]*$`)
	flagName    = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]*$`)
)

// Berth's own admission plugins: PodSecurity (with Berth's configuration, exempting the
// joinservice's RuntimeClass), NodeRestriction (a node writes only its own objects), and the
// admission policies and webhooks that guard berth-system, the revocation of removed nodes and
// the image policy.
var protectedPlugins = []string{"PodSecurity", "NodeRestriction", "ValidatingAdmissionPolicy", "ValidatingAdmissionWebhook"}

// Flags Berth sets itself, by component: through the fields of this configuration, or for its own
// guarantees (encryption at rest, admission, aggregator routing).
var (
	commonReserved    = []string{"feature-gates"}
	apiServerReserved = []string{
		"admission-control-config-file", "enable-admission-plugins", "disable-admission-plugins", "admission-control",
		"encryption-provider-config", "enable-aggregator-routing",
		"audit-policy-file", "audit-log-path", "audit-log-maxage", "audit-log-maxbackup", "audit-log-maxsize",
		"oidc-issuer-url", "oidc-client-id", "oidc-username-claim", "oidc-username-prefix", "oidc-groups-claim",
		"oidc-groups-prefix", "oidc-ca-file", "oidc-required-claim", "authentication-config",
	}
)

var (
	patchTargets = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd", "kubeletconfiguration"}
	patchTypes   = []string{"strategic", "merge", "json"}
	pathTypes    = []string{"", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"}
	proxyModes   = []string{"", "iptables", "ipvs", "nftables"}
	auditLevels  = []string{string(auditv1.LevelNone), string(auditv1.LevelMetadata), string(auditv1.LevelRequest), string(auditv1.LevelRequestResponse)}
)

// Validate checks a defaulted configuration and returns every problem with its field's path.
func Validate(c *ClusterConfiguration) field.ErrorList {
	var errs field.ErrorList
	if c.APIVersion != APIVersion {
		errs = append(errs, field.NotSupported(field.NewPath("apiVersion"), c.APIVersion, []string{APIVersion}))
	}
	if c.Kind != Kind {
		errs = append(errs, field.NotSupported(field.NewPath("kind"), c.Kind, []string{Kind}))
	}
	for _, msg := range validation.IsDNS1123Label(c.ClusterName) {
		errs = append(errs, field.Invalid(field.NewPath("clusterName"), c.ClusterName, msg))
	}
	if !kubeVersion.MatchString(c.KubernetesVersion) {
		errs = append(errs, field.Invalid(field.NewPath("kubernetesVersion"), c.KubernetesVersion, "must be of the form v1.MINOR.PATCH"))
	} else if _, err := k8sversion.Lookup(c.KubernetesVersion); err != nil {
		var supported []string
		for _, r := range k8sversion.Supported() {
			supported = append(supported, r.Kubernetes)
		}
		errs = append(errs, field.NotSupported(field.NewPath("kubernetesVersion"), c.KubernetesVersion, supported))
	}
	errs = append(errs, validateNetworking(&c.Networking, field.NewPath("networking"))...)
	errs = append(errs, validateAPIServer(&c.APIServer, field.NewPath("apiServer"))...)
	errs = append(errs, validateComponent(&c.ControllerManager, field.NewPath("controllerManager"), commonReserved)...)
	errs = append(errs, validateComponent(&c.Scheduler, field.NewPath("scheduler"), commonReserved)...)
	errs = append(errs, validateFeatureGates(c.FeatureGates, c.KubernetesVersion, field.NewPath("featureGates"))...)
	for i, p := range c.Patches {
		errs = append(errs, validatePatch(p, field.NewPath("patches").Index(i))...)
	}
	if c.Kubelet != nil {
		errs = append(errs, validateKubelet(c.Kubelet, field.NewPath("kubelet"))...)
		errs = append(errs, validateFeatureGates(c.Kubelet.FeatureGates, c.KubernetesVersion, field.NewPath("kubelet", "featureGates"))...)
	}
	if c.KubeProxy != nil {
		errs = append(errs, validateFeatureGates(c.KubeProxy.FeatureGates, c.KubernetesVersion, field.NewPath("kubeProxy", "featureGates"))...)
	}
	if c.KubeProxy != nil && !slices.Contains(proxyModes, string(c.KubeProxy.Mode)) {
		errs = append(errs, field.NotSupported(field.NewPath("kubeProxy", "mode"), c.KubeProxy.Mode, proxyModes[1:]))
	}
	return errs
}

func validateNetworking(n *Networking, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	var nets []*net.IPNet
	for _, f := range [][2]string{{"serviceSubnet", n.ServiceSubnet}, {"podSubnet", n.PodSubnet}} {
		name, cidr := f[0], f[1]
		_, ipnet, err := net.ParseCIDR(cidr)
		if err != nil {
			errs = append(errs, field.Invalid(path.Child(name), cidr, "must be a CIDR, e.g. 10.96.0.0/12"))
			continue
		}
		nets = append(nets, ipnet)
	}
	if len(nets) == 2 && (nets[0].Contains(nets[1].IP) || nets[1].Contains(nets[0].IP)) {
		errs = append(errs, field.Invalid(path.Child("podSubnet"), n.PodSubnet, "overlaps serviceSubnet"))
	}
	return errs
}

func validateAPIServer(a *APIServer, path *field.Path) field.ErrorList {
	errs := validateComponent(&a.ControlPlaneComponent, path, append(slices.Clone(commonReserved), apiServerReserved...))
	for i, san := range a.CertSANs {
		if net.ParseIP(san) == nil && len(validation.IsDNS1123Subdomain(strings.TrimPrefix(san, "*."))) > 0 {
			errs = append(errs, field.Invalid(path.Child("certSANs").Index(i), san, "must be an IP address or a DNS name"))
		}
	}
	if au := a.Audit; au != nil {
		p := path.Child("audit")
		if len(au.Policy.Rules) == 0 {
			errs = append(errs, field.Required(p.Child("policy", "rules"), "an audit policy without rules records nothing"))
		}
		for i, r := range au.Policy.Rules {
			if !slices.Contains(auditLevels, string(r.Level)) {
				errs = append(errs, field.NotSupported(p.Child("policy", "rules").Index(i).Child("level"), r.Level, auditLevels))
			}
		}
		if !filepath.IsAbs(au.LogPath) || filepath.Clean(au.LogPath) != au.LogPath || filepath.Dir(au.LogPath) == "/" {
			errs = append(errs, field.Invalid(p.Child("logPath"), au.LogPath, "must be a clean absolute path below a directory other than /"))
		}
		for _, f := range []struct {
			name string
			v    int32
		}{{"maxAge", au.MaxAge}, {"maxBackups", au.MaxBackups}, {"maxSize", au.MaxSize}} {
			if f.v < 0 {
				errs = append(errs, field.Invalid(p.Child(f.name), f.v, "must not be negative"))
			}
		}
	}
	if o := a.OIDC; o != nil {
		p := path.Child("oidc")
		if u, err := url.Parse(o.IssuerURL); err != nil || u.Scheme != "https" || u.Host == "" {
			errs = append(errs, field.Invalid(p.Child("issuerURL"), o.IssuerURL, "must be an https URL"))
		}
		if o.ClientID == "" {
			errs = append(errs, field.Required(p.Child("clientID"), ""))
		}
		if o.CAFile != "" && !filepath.IsAbs(o.CAFile) {
			errs = append(errs, field.Invalid(p.Child("caFile"), o.CAFile, "must be an absolute path on the control plane"))
		}
	}
	errs = append(errs, validateAdmission(&a.Admission, path.Child("admission"))...)
	return errs
}

func validateAdmission(a *Admission, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	for i, name := range a.DisablePlugins {
		if slices.Contains(protectedPlugins, name) {
			errs = append(errs, field.Forbidden(path.Child("disablePlugins").Index(i),
				fmt.Sprintf("%s is one of Berth's guards (%s) and stays enabled", name, strings.Join(protectedPlugins, ", "))))
		}
		if slices.Contains(a.EnablePlugins, name) {
			errs = append(errs, field.Invalid(path.Child("disablePlugins").Index(i), name, "is also in enablePlugins"))
		}
	}
	for i, name := range a.EnablePlugins {
		if name == "" || strings.Contains(name, ",") {
			errs = append(errs, field.Invalid(path.Child("enablePlugins").Index(i), name, "must be an admission plugin's name"))
		}
	}
	seen := map[string]bool{}
	for i, pl := range a.Plugins {
		p := path.Child("plugins").Index(i)
		switch {
		case pl.Name == "PodSecurity":
			errs = append(errs, field.Forbidden(p.Child("name"),
				"Berth configures PodSecurity itself (its configuration exempts only the joinservice's RuntimeClass); set Pod Security per namespace with its labels"))
		case pl.Name == "":
			errs = append(errs, field.Required(p.Child("name"), ""))
		case seen[pl.Name]:
			errs = append(errs, field.Duplicate(p.Child("name"), pl.Name))
		}
		seen[pl.Name] = true
		if len(pl.Configuration.Raw) == 0 {
			errs = append(errs, field.Required(p.Child("configuration"), ""))
		}
	}
	return errs
}

func validateComponent(c *ControlPlaneComponent, path *field.Path, reserved []string) field.ErrorList {
	var errs field.ErrorList
	seen := map[string]bool{}
	for i, a := range c.ExtraArgs {
		p := path.Child("extraArgs").Index(i).Child("name")
		switch {
		case !flagName.MatchString(a.Name):
			errs = append(errs, field.Invalid(p, a.Name, "must be a flag's name without leading dashes"))
		case slices.Contains(reserved, a.Name):
			errs = append(errs, field.Forbidden(p, fmt.Sprintf("Berth sets --%s itself; use this configuration's own fields", a.Name)))
		case seen[a.Name]:
			errs = append(errs, field.Duplicate(p, a.Name))
		}
		seen[a.Name] = true
	}
	names, mounts := map[string]bool{}, map[string]bool{}
	for i, v := range c.ExtraVolumes {
		p := path.Child("extraVolumes").Index(i)
		for _, msg := range validation.IsDNS1123Label(v.Name) {
			errs = append(errs, field.Invalid(p.Child("name"), v.Name, msg))
		}
		if strings.HasPrefix(v.Name, "berth-") {
			errs = append(errs, field.Invalid(p.Child("name"), v.Name, "names starting with berth- are Berth's own volumes"))
		}
		if names[v.Name] {
			errs = append(errs, field.Duplicate(p.Child("name"), v.Name))
		}
		names[v.Name] = true
		for _, f := range [][2]string{{"hostPath", v.HostPath}, {"mountPath", v.MountPath}} {
			if !filepath.IsAbs(f[1]) {
				errs = append(errs, field.Invalid(p.Child(f[0]), f[1], "must be an absolute path"))
			}
		}
		if mounts[v.MountPath] {
			errs = append(errs, field.Duplicate(p.Child("mountPath"), v.MountPath))
		}
		mounts[v.MountPath] = true
		if !slices.Contains(pathTypes, v.PathType) {
			errs = append(errs, field.NotSupported(p.Child("pathType"), v.PathType, pathTypes[1:]))
		}
	}
	return errs
}

func validatePatch(p Patch, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	if !slices.Contains(patchTargets, p.Target) {
		errs = append(errs, field.NotSupported(path.Child("target"), p.Target, patchTargets))
	}
	if !slices.Contains(patchTypes, p.Type) {
		errs = append(errs, field.NotSupported(path.Child("type"), p.Type, patchTypes))
	}
	var doc any
	switch err := yaml.Unmarshal([]byte(p.Patch), &doc); {
	case strings.TrimSpace(p.Patch) == "":
		errs = append(errs, field.Required(path.Child("patch"), ""))
	case err != nil:
		errs = append(errs, field.Invalid(path.Child("patch"), "", fmt.Sprintf("not YAML or JSON: %v", err)))
	case p.Type == "json":
		if _, ok := doc.([]any); !ok {
			errs = append(errs, field.Invalid(path.Child("patch"), "", "a json patch is a list of operations"))
		}
	default:
		if _, ok := doc.(map[string]any); !ok {
			errs = append(errs, field.Invalid(path.Child("patch"), "", "a strategic or merge patch is an object"))
		}
	}
	return errs
}

// validateKubelet refuses kubelet settings that would undo what Berth relies on: the node's cgroup
// driver, and an API that needs authentication and authorization (it runs commands in every pod
// of the node).
func validateKubelet(k *kubeletv1beta1.KubeletConfiguration, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	if k.CgroupDriver != "" {
		errs = append(errs, field.Forbidden(path.Child("cgroupDriver"), "Berth sets the cgroup driver from the node's container runtime"))
	}
	if a := k.Authentication.Anonymous.Enabled; a != nil && *a {
		errs = append(errs, field.Forbidden(path.Child("authentication", "anonymous", "enabled"), "the kubelet's API runs commands in the node's pods and must not be anonymous"))
	}
	if k.Authorization.Mode == kubeletv1beta1.KubeletAuthorizationModeAlwaysAllow {
		errs = append(errs, field.Forbidden(path.Child("authorization", "mode"), "the kubelet's API runs commands in the node's pods and must authorize through the API server (Webhook)"))
	}
	if k.MaxPods < 0 {
		errs = append(errs, field.Invalid(path.Child("maxPods"), k.MaxPods, "must not be negative"))
	}
	return errs
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// validateFeatureGates checks that every gate's name is one Kubernetes at kubernetesVersion knows
// (gateKnown); an unknown one is an error at its key.
func validateFeatureGates(gates map[string]bool, kubernetesVersion string, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	for _, name := range sortedKeys(gates) {
		switch {
		case !featureGate.MatchString(name):
			errs = append(errs, field.Invalid(path.Key(name), name, "must be a feature gate's name, e.g. InPlacePodVerticalScaling"))
		case !gateKnown(name, kubernetesVersion):
			errs = append(errs, field.Invalid(path.Key(name), name, "is not a feature gate of Kubernetes "+kubernetesVersion))
		}
	}
	return errs
}
