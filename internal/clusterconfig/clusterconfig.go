// Package clusterconfig owns Berth's versioned cluster configuration, config.berth.dev/v1alpha1
// ClusterConfiguration: its typed form, its defaults, strict decoding (an unknown field or a wrong
// type is an error naming the field's path), validation naming the field's path, the older
// unversioned init config read into it with a warning, and the ConfigMap that keeps the
// configuration in force in the cluster. REFERENCE.md and clusterconfig.schema.json, beside this
// file, are generated from its types.
package clusterconfig

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation/field"
	auditv1 "k8s.io/apiserver/pkg/apis/audit/v1"
	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/k8sversion"
)

const (
	// Group is the API group of Berth's configuration files.
	Group = "config.berth.dev"
	// Version is the version of ClusterConfiguration this package reads and writes.
	Version = "v1alpha1"
	// APIVersion is Group/Version.
	APIVersion = Group + "/" + Version
	// Kind is the kind of the cluster configuration.
	Kind = "ClusterConfiguration"
	// DefaultAuditLogPath is where the API server writes its audit log unless audit.logPath says.
	DefaultAuditLogPath = "/var/log/kubernetes/audit/audit.log"
)

// DefaultKubernetesVersion is the Kubernetes version a configuration without one deploys: the
// default of the supported releases (internal/k8sversion).
var DefaultKubernetesVersion = k8sversion.Default().Kubernetes

// ErrInvalid wraps every refusal of a configuration: a syntax error, an unknown field, a wrong
// type, a value validation refuses.
var ErrInvalid = errors.New("invalid cluster configuration")

// Default returns the configuration a file's missing fields take.
func Default() ClusterConfiguration {
	c := ClusterConfiguration{}
	SetDefaults(&c)
	return c
}

// SetDefaults fills c's unset fields with their defaults.
func SetDefaults(c *ClusterConfiguration) {
	c.APIVersion, c.Kind = APIVersion, Kind
	setString(&c.ClusterName, "berth")
	setString(&c.KubernetesVersion, DefaultKubernetesVersion)
	setString(&c.Networking.ServiceSubnet, "10.96.0.0/12")
	setString(&c.Networking.PodSubnet, "10.244.0.0/16")
	if a := c.APIServer.Audit; a != nil {
		setString(&a.LogPath, DefaultAuditLogPath)
		if a.MaxBackups == 0 {
			a.MaxBackups = 10
		}
		if a.MaxSize == 0 {
			a.MaxSize = 100
		}
	}
	if o := c.APIServer.OIDC; o != nil {
		setString(&o.UsernameClaim, "sub")
	}
	for i := range c.Patches {
		setString(&c.Patches[i].Type, "strategic")
	}
}

func setString(p *string, def string) {
	if *p == "" {
		*p = def
	}
}

// Decode reads a configuration document (YAML or JSON) strictly: an unknown or duplicate field
// and a value of the wrong type are errors naming the field's path. A document without apiVersion
// and kind is the unversioned init config of earlier releases: it is read into the versioned form,
// and the returned warnings say so. Decode neither defaults nor validates.
func Decode(data []byte) (ClusterConfiguration, []string, error) {
	var c ClusterConfiguration
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return c, nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := json.Unmarshal(js, &head); err != nil {
		// Not an object, or apiVersion or kind not strings: the strict decoding says where.
		if err := decodeStrict(js, &c); err != nil {
			return c, nil, err
		}
		return c, nil, fmt.Errorf("%w: the document is not an object", ErrInvalid)
	}
	if head.APIVersion == "" && head.Kind == "" {
		c, err := decodeLegacy(js)
		if err != nil {
			return c, nil, err
		}
		return c, []string{fmt.Sprintf("the configuration has no apiVersion and kind: read as the unversioned init config of earlier releases; "+
			"`berth config show` prints it as %s %s", APIVersion, Kind)}, nil
	}
	var errs field.ErrorList
	if head.APIVersion != APIVersion {
		errs = append(errs, field.NotSupported(field.NewPath("apiVersion"), head.APIVersion, []string{APIVersion}))
	}
	if head.Kind != Kind {
		errs = append(errs, field.NotSupported(field.NewPath("kind"), head.Kind, []string{Kind}))
	}
	if len(errs) > 0 {
		return c, nil, fmt.Errorf("%w: %w", ErrInvalid, errs.ToAggregate())
	}
	if err := decodeStrict(js, &c); err != nil {
		return c, nil, err
	}
	return c, nil, nil
}

// decodeStrict decodes js into v, refusing unknown and duplicate fields and wrong types with the
// field's path.
func decodeStrict(js []byte, v any) error {
	strict, err := sigsjson.UnmarshalStrict(js, v, sigsjson.DisallowUnknownFields, sigsjson.DisallowDuplicateFields)
	if err != nil {
		if m := typeError.FindStringSubmatch(err.Error()); m != nil {
			return fmt.Errorf("%w: %s: wrong type: got %s, want %s", ErrInvalid, m[2], m[1], m[3])
		}
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(strict) > 0 {
		msgs := make([]string, len(strict))
		for i, e := range strict {
			msgs[i] = e.Error()
		}
		return fmt.Errorf("%w: %s", ErrInvalid, strings.Join(msgs, "; "))
	}
	return nil
}

// typeError is the decoder's message about a value of the wrong type: what it got, the field's
// path (after the Go struct's name), the Go type it wanted.
var typeError = regexp.MustCompile(`cannot unmarshal (.+) into Go struct field [^.]+\.(\S+) of type (.+)$`)

// legacy is the unversioned init config of earlier releases.
type legacy struct {
	ClusterName           string   `json:"clusterName"`
	KubernetesVersion     string   `json:"kubernetesVersion"`
	ServiceCIDR           string   `json:"serviceCIDR"`
	PodCIDR               string   `json:"podCIDR"`
	APIServerCertSANs     []string `json:"apiServerCertSANs,omitempty"`
	InitSecret            string   `json:"initSecret,omitempty"`
	InitSecretFile        string   `json:"initSecretFile,omitempty"`
	AttestationPolicyFile string   `json:"attestationPolicyFile,omitempty"`
	JoinPolicyFile        string   `json:"joinPolicyFile,omitempty"`
	Components            struct {
		SkipKubeProxy   bool   `json:"skipKubeProxy,omitempty"`
		SkipCoreDNS     bool   `json:"skipCoreDNS,omitempty"`
		ImagePolicyFile string `json:"imagePolicyFile,omitempty"`
	} `json:"components,omitempty"`
}

func decodeLegacy(js []byte) (ClusterConfiguration, error) {
	var l legacy
	if err := decodeStrict(js, &l); err != nil {
		return ClusterConfiguration{}, err
	}
	return ClusterConfiguration{
		APIVersion:        APIVersion,
		Kind:              Kind,
		ClusterName:       l.ClusterName,
		KubernetesVersion: l.KubernetesVersion,
		Networking:        Networking{ServiceSubnet: l.ServiceCIDR, PodSubnet: l.PodCIDR},
		APIServer:         APIServer{CertSANs: l.APIServerCertSANs},
		Components:        Components{SkipKubeProxy: l.Components.SkipKubeProxy, SkipCoreDNS: l.Components.SkipCoreDNS},
		Policies: Policies{
			AttestationPolicyFile: l.AttestationPolicyFile,
			ImagePolicyFile:       l.Components.ImagePolicyFile,
			JoinPolicyFile:        l.JoinPolicyFile,
		},
		InitSecretFile: l.InitSecretFile,
		InitSecret:     l.InitSecret,
	}, nil
}

// Parse decodes, defaults and validates a configuration document.
func Parse(data []byte) (ClusterConfiguration, []string, error) {
	c, warnings, err := Decode(data)
	if err != nil {
		return c, warnings, err
	}
	SetDefaults(&c)
	if errs := Validate(&c); len(errs) > 0 {
		return c, warnings, fmt.Errorf("%w: %w", ErrInvalid, errs.ToAggregate())
	}
	return c, warnings, nil
}

// Marshal returns c as a YAML document that Decode reads back. The embedded kubelet, kube-proxy
// and audit configurations lose their apiVersion and kind and the fields left unset
// (CompactYAML).
func Marshal(c ClusterConfiguration) ([]byte, error) {
	c.APIVersion, c.Kind = APIVersion, Kind
	doc, err := toTree(c)
	if err != nil {
		return nil, err
	}
	m := doc.(map[string]any)
	subtree := func(parent map[string]any, key string, zero any) error {
		sub, ok := parent[key].(map[string]any)
		if !ok {
			return nil
		}
		z, err := toTree(zero)
		if err != nil {
			return err
		}
		delete(sub, "apiVersion")
		delete(sub, "kind")
		if parent[key] = compact(sub, z); parent[key] == nil {
			parent[key] = map[string]any{}
		}
		return nil
	}
	if err := subtree(m, "kubelet", kubeletv1beta1.KubeletConfiguration{}); err != nil {
		return nil, err
	}
	if err := subtree(m, "kubeProxy", kubeproxyv1alpha1.KubeProxyConfiguration{}); err != nil {
		return nil, err
	}
	if api, ok := m["apiServer"].(map[string]any); ok {
		if audit, ok := api["audit"].(map[string]any); ok {
			if err := subtree(audit, "policy", auditv1.Policy{}); err != nil {
				return nil, err
			}
		}
	}
	data, err := yaml.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encoding the cluster configuration: %w", err)
	}
	return data, nil
}

// CompactYAML encodes v, a struct or a pointer to one, as YAML without the fields left unset: a
// field whose value is its type's zero value and not a pointer. A pointer's value stays when set,
// even to a zero value (kube-proxy's conntrack.maxPerCore: 0 means "leave the host's alone").
// Component configurations, whose decoding defaults every unset field, read the same.
func CompactYAML(v any) ([]byte, error) {
	t := reflect.TypeOf(v)
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	a, err := toTree(v)
	if err != nil {
		return nil, err
	}
	z, err := toTree(reflect.Zero(t).Interface())
	if err != nil {
		return nil, err
	}
	data, err := yaml.Marshal(compact(a, z))
	if err != nil {
		return nil, fmt.Errorf("encoding %T: %w", v, err)
	}
	return data, nil
}

// toTree returns v as decoded JSON.
func toTree(v any) (any, error) {
	js, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("encoding %T: %w", v, err)
	}
	var t any
	if err := json.Unmarshal(js, &t); err != nil {
		return nil, fmt.Errorf("encoding %T: %w", v, err)
	}
	return t, nil
}

// compact drops from the decoded JSON a what equals the zero value's encoding z at the same place
// (and nulls and empty objects); nil when nothing is left. Where z has null (a nil pointer) or
// nothing, a's value stays.
func compact(a, z any) any {
	switch t := a.(type) {
	case nil:
		return nil
	case map[string]any:
		zm, _ := z.(map[string]any)
		for k, e := range t {
			if c := compact(e, zm[k]); c == nil {
				delete(t, k)
			} else {
				t[k] = c
			}
		}
		if len(t) == 0 {
			return nil
		}
		return t
	}
	if z != nil && reflect.DeepEqual(a, z) {
		return nil
	}
	return a
}

// KubeletConfiguration returns the kubelet configuration Berth gives every node: the operator's,
// with its apiVersion and kind set.
func (c *ClusterConfiguration) KubeletConfiguration() kubeletv1beta1.KubeletConfiguration {
	var k kubeletv1beta1.KubeletConfiguration
	if c.Kubelet != nil {
		c.Kubelet.DeepCopyInto(&k)
	}
	k.APIVersion, k.Kind = kubeletv1beta1.SchemeGroupVersion.String(), "KubeletConfiguration"
	if len(c.FeatureGates) > 0 {
		if k.FeatureGates == nil {
			k.FeatureGates = map[string]bool{}
		}
		for name, on := range c.FeatureGates {
			if _, set := k.FeatureGates[name]; !set {
				k.FeatureGates[name] = on
			}
		}
	}
	return k
}

// KubeProxyConfiguration returns kube-proxy's configuration: the operator's, with its apiVersion
// and kind set and the cluster's feature gates; nil when neither sets anything.
func (c *ClusterConfiguration) KubeProxyConfiguration() *kubeproxyv1alpha1.KubeProxyConfiguration {
	if c.KubeProxy == nil && len(c.FeatureGates) == 0 {
		return nil
	}
	var p kubeproxyv1alpha1.KubeProxyConfiguration
	if c.KubeProxy != nil {
		c.KubeProxy.DeepCopyInto(&p)
	}
	p.APIVersion, p.Kind = "kubeproxy.config.k8s.io/v1alpha1", "KubeProxyConfiguration"
	for name, on := range c.FeatureGates {
		if p.FeatureGates == nil {
			p.FeatureGates = map[string]bool{}
		}
		if _, set := p.FeatureGates[name]; !set {
			p.FeatureGates[name] = on
		}
	}
	return &p
}
