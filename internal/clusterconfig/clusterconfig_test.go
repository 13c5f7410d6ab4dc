package clusterconfig

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
)

const full = `apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
clusterName: prod
kubernetesVersion: v1.36.3
networking: {serviceSubnet: 10.100.0.0/16, podSubnet: 10.200.0.0/16}
apiServer:
  certSANs: [192.0.2.1, api.example.com]
  extraArgs: [{name: max-requests-inflight, value: "800"}]
  extraVolumes: [{name: extra, hostPath: /srv/extra, mountPath: /srv/extra, readOnly: true, pathType: Directory}]
  audit:
    policy: {rules: [{level: Metadata}]}
  oidc: {issuerURL: "https://issuer.example.com", clientID: kubernetes, groupsClaim: groups}
  admission:
    enablePlugins: [EventRateLimit]
    plugins:
    - name: EventRateLimit
      configuration: {apiVersion: eventratelimit.admission.k8s.io/v1alpha1, kind: Configuration, limits: [{type: Server, qps: 50, burst: 100}]}
controllerManager: {extraArgs: [{name: node-monitor-grace-period, value: 50s}]}
featureGates: {InPlacePodVerticalScaling: true}
patches: [{target: kube-apiserver, type: merge, patch: "metadata: {annotations: {a: b}}"}]
kubelet: {maxPods: 42}
kubeProxy: {mode: nftables}
components: {skipCoreDNS: true}
policies: {attestationPolicyFile: policy.yaml, imagePolicyFile: images.yaml}
initSecretFile: init-secret
`

// TestParseFull: every part of the configuration decodes, and the defaults fill the rest.
func TestParseFull(t *testing.T) {
	c, warnings, err := Parse([]byte(full))
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 0 {
		t.Errorf("warnings = %q", warnings)
	}
	if c.Kubelet.MaxPods != 42 || c.KubeProxy.Mode != "nftables" || c.APIServer.Audit.LogPath != DefaultAuditLogPath ||
		c.APIServer.Audit.MaxBackups != 10 || c.APIServer.OIDC.UsernameClaim != "sub" || c.Patches[0].Type != "merge" ||
		c.Networking.PodSubnet != "10.200.0.0/16" || !c.FeatureGates["InPlacePodVerticalScaling"] {
		t.Errorf("Parse = %+v", c)
	}
	if k := c.KubeletConfiguration(); k.Kind != "KubeletConfiguration" || !k.FeatureGates["InPlacePodVerticalScaling"] || k.MaxPods != 42 {
		t.Errorf("KubeletConfiguration = %+v", k)
	}
	if p := c.KubeProxyConfiguration(); p.Kind != "KubeProxyConfiguration" || p.Mode != "nftables" || !p.FeatureGates["InPlacePodVerticalScaling"] {
		t.Errorf("KubeProxyConfiguration = %+v", p)
	}
}

// TestMarshalRoundTrips: what Marshal writes, Parse reads back unchanged, and the ConfigMap
// keeps it without the operator's local paths.
func TestMarshalRoundTrips(t *testing.T) {
	in, _, err := Parse([]byte(full))
	if err != nil {
		t.Fatal(err)
	}
	data, err := Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := Parse(data)
	if err != nil {
		t.Fatalf("Parse(Marshal(c)): %v\n%s", err, data)
	}
	if !equality.Semantic.DeepEqual(out, in) {
		t.Errorf("Parse(Marshal(c)) = %+v, want %+v", out, in)
	}
	cm, err := ConfigMap(in)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(cm.Data[ConfigMapKey], "init-secret") || strings.Contains(cm.Data[ConfigMapKey], "policy.yaml") {
		t.Errorf("the ConfigMap keeps the operator's paths:\n%s", cm.Data[ConfigMapKey])
	}
	stored, err := FromConfigMap(cm)
	if err != nil {
		t.Fatal(err)
	}
	if !equality.Semantic.DeepEqual(stored, in.InCluster()) {
		t.Errorf("FromConfigMap = %+v, want %+v", stored, in.InCluster())
	}
	if _, err := FromConfigMap(&corev1.ConfigMap{}); !errors.Is(err, ErrInvalid) {
		t.Errorf("FromConfigMap(empty) = %v", err)
	}
}

// TestLegacy: the unversioned init config still reads, with a warning, into the versioned form;
// its inline secret is kept in memory only.
func TestLegacy(t *testing.T) {
	c, warnings, err := Parse([]byte("clusterName: c1\nserviceCIDR: 10.100.0.0/16\napiServerCertSANs: [192.0.2.1]\ninitSecret: 00112233445566778899aabbccddeeff\n" +
		"attestationPolicyFile: p.yaml\ncomponents: {skipKubeProxy: true, imagePolicyFile: i.yaml}\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], "no apiVersion and kind") {
		t.Errorf("warnings = %q", warnings)
	}
	want := Default()
	want.ClusterName = "c1"
	want.Networking.ServiceSubnet = "10.100.0.0/16"
	want.APIServer.CertSANs = []string{"192.0.2.1"}
	want.InitSecret = "00112233445566778899aabbccddeeff"
	want.Policies = Policies{AttestationPolicyFile: "p.yaml", ImagePolicyFile: "i.yaml"}
	want.Components.SkipKubeProxy = true
	if !reflect.DeepEqual(c, want) {
		t.Errorf("Parse(legacy) = %+v, want %+v", c, want)
	}
	data, err := Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(data), "00112233") {
		t.Errorf("Marshal writes the init secret:\n%s", data)
	}
	if _, _, err := Parse([]byte("clusterName: c1\nkubelet: {maxPods: 3}\n")); err == nil || !strings.Contains(err.Error(), `unknown field "kubelet"`) {
		t.Errorf("legacy with a versioned field: %v", err)
	}
}

// TestRefused: each malformed configuration is refused with its field's path named.
func TestRefused(t *testing.T) {
	const head = "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\n"
	for name, tc := range map[string]struct{ doc, want string }{
		"unknown field":            {head + "apiServer: {extraArg: []}\n", `unknown field "apiServer.extraArg"`},
		"unknown kubelet field":    {head + "kubelet: {maxPodz: 3}\n", `unknown field "kubelet.maxPodz"`},
		"unknown top field":        {head + "bogus: 1\n", `unknown field "bogus"`},
		"duplicate field":          {head + "clusterName: a\nclusterName: b\n", `clusterName`},
		"wrong type":               {head + "kubelet: {maxPods: many}\n", "kubelet.maxPods: wrong type: got string, want int32"},
		"wrong type nested":        {head + "apiServer: {certSANs: 3}\n", "apiServer.certSANs: wrong type: got number"},
		"wrong apiVersion":         {"apiVersion: config.berth.dev/v9\nkind: ClusterConfiguration\n", `apiVersion: Unsupported value: "config.berth.dev/v9"`},
		"wrong kind":               {"apiVersion: config.berth.dev/v1alpha1\nkind: Cluster\n", `kind: Unsupported value: "Cluster"`},
		"PodSecurity override":     {head + "apiServer: {admission: {plugins: [{name: PodSecurity, configuration: {defaults: {enforce: privileged}}}]}}\n", "apiServer.admission.plugins[0].name: Forbidden: Berth configures PodSecurity itself"},
		"PodSecurity disabled":     {head + "apiServer: {admission: {disablePlugins: [PodSecurity]}}\n", "apiServer.admission.disablePlugins[0]: Forbidden: PodSecurity is one of Berth's guards"},
		"NodeRestriction disabled": {head + "apiServer: {admission: {disablePlugins: [Foo, NodeRestriction]}}\n", "apiServer.admission.disablePlugins[1]: Forbidden"},
		"admission flag":           {head + "apiServer: {extraArgs: [{name: admission-control-config-file, value: /x}]}\n", "apiServer.extraArgs[0].name: Forbidden: Berth sets --admission-control-config-file itself"},
		"disable flag":             {head + "apiServer: {extraArgs: [{name: a, value: b}, {name: disable-admission-plugins, value: PodSecurity}]}\n", "apiServer.extraArgs[1].name: Forbidden"},
		"feature-gates flag":       {head + "scheduler: {extraArgs: [{name: feature-gates, value: A=true}]}\n", "scheduler.extraArgs[0].name: Forbidden"},
		"dashes":                   {head + "controllerManager: {extraArgs: [{name: --v, value: '2'}]}\n", "controllerManager.extraArgs[0].name: Invalid value"},
		"duplicate flag":           {head + "apiServer: {extraArgs: [{name: v, value: '2'}, {name: v, value: '3'}]}\n", "apiServer.extraArgs[1].name: Duplicate value"},
		"relative volume":          {head + "apiServer: {extraVolumes: [{name: x, hostPath: srv, mountPath: /srv}]}\n", "apiServer.extraVolumes[0].hostPath: Invalid value"},
		"berth volume":             {head + "apiServer: {extraVolumes: [{name: berth-admission, hostPath: /a, mountPath: /a}]}\n", "apiServer.extraVolumes[0].name: Invalid value"},
		"path type":                {head + "apiServer: {extraVolumes: [{name: x, hostPath: /a, mountPath: /a, pathType: Dir}]}\n", "apiServer.extraVolumes[0].pathType: Unsupported value"},
		"no audit rules":           {head + "apiServer: {audit: {policy: {}}}\n", "apiServer.audit.policy.rules: Required value"},
		"audit level":              {head + "apiServer: {audit: {policy: {rules: [{level: All}]}}}\n", "apiServer.audit.policy.rules[0].level: Unsupported value"},
		"audit path":               {head + "apiServer: {audit: {policy: {rules: [{level: None}]}, logPath: audit.log}}\n", "apiServer.audit.logPath: Invalid value"},
		"oidc http":                {head + "apiServer: {oidc: {issuerURL: 'http://i', clientID: c}}\n", "apiServer.oidc.issuerURL: Invalid value"},
		"oidc client":              {head + "apiServer: {oidc: {issuerURL: 'https://i'}}\n", "apiServer.oidc.clientID: Required value"},
		"cluster name":             {head + "clusterName: Prod_1\n", "clusterName: Invalid value"},
		"version":                  {head + "kubernetesVersion: v1.34\n", "kubernetesVersion: Invalid value"},
		"pod subnet":               {head + "networking: {podSubnet: 10.0.0.0}\n", "networking.podSubnet: Invalid value"},
		"overlap":                  {head + "networking: {podSubnet: 10.96.0.0/16}\n", "networking.podSubnet: Invalid value: \"10.96.0.0/16\": overlaps serviceSubnet"},
		"san":                      {head + "apiServer: {certSANs: ['not a name']}\n", "apiServer.certSANs[0]: Invalid value"},
		"feature gate":             {head + "featureGates: {'bad-gate': true}\n", "featureGates[bad-gate]: Invalid value"},
		"unknown feature gate":     {head + "featureGates: {InPlacePodVerticalScaling: true, Foo: true}\n", `featureGates[Foo]: Invalid value: "Foo": is not a feature gate of Kubernetes v1.37.`},
		"unknown kubelet gate":     {head + "kubelet: {featureGates: {NoSuchKubeletGate: false}}\n", `kubelet.featureGates[NoSuchKubeletGate]: Invalid value`},
		"unknown kube-proxy gate":  {head + "kubeProxy: {featureGates: {NoSuchProxyGate: true}}\n", `kubeProxy.featureGates[NoSuchProxyGate]: Invalid value`},
		"gate of a later minor":    {head + "kubernetesVersion: v1.36.3\nfeatureGates: {CompositePodGroup: true}\n", `featureGates[CompositePodGroup]: Invalid value: "CompositePodGroup": is not a feature gate of Kubernetes v1.36.3`},
		"patch target":             {head + "patches: [{target: kube-proxy, patch: 'a: b'}]\n", "patches[0].target: Unsupported value"},
		"json patch":               {head + "patches: [{target: etcd, type: json, patch: 'a: b'}]\n", "patches[0].patch: Invalid value"},
		"empty patch":              {head + "patches: [{target: etcd}]\n", "patches[0].patch: Required value"},
		"cgroup driver":            {head + "kubelet: {cgroupDriver: cgroupfs}\n", "kubelet.cgroupDriver: Forbidden"},
		"anonymous kubelet":        {head + "kubelet: {authentication: {anonymous: {enabled: true}}}\n", "kubelet.authentication.anonymous.enabled: Forbidden"},
		"kubelet AlwaysAllow":      {head + "kubelet: {authorization: {mode: AlwaysAllow}}\n", "kubelet.authorization.mode: Forbidden"},
		"proxy mode":               {head + "kubeProxy: {mode: userspace}\n", "kubeProxy.mode: Unsupported value"},
		"not an object":            {"- a\n", "invalid cluster configuration"},
		"not YAML":                 {"a: [\n", "invalid cluster configuration"},
	} {
		_, _, err := Parse([]byte(tc.doc))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Parse = %v, want an error containing %q", name, err, tc.want)
		}
	}
}

// TestAcceptsWhatItMayOverride: the settings next to the refused ones are accepted, so that the
// refusals above are about the field they name.
func TestAcceptsWhatItMayOverride(t *testing.T) {
	const head = "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\n"
	for _, doc := range []string{
		head + "apiServer: {admission: {disablePlugins: [DefaultStorageClass]}}\n",
		head + "apiServer: {extraArgs: [{name: v, value: '2'}]}\n",
		head + "kubelet: {authentication: {anonymous: {enabled: false}}, authorization: {mode: Webhook}}\n",
		head + "patches: [{target: etcd, type: json, patch: '[{op: add, path: /metadata/labels/a, value: b}]'}]\n",
		// Gates of the kubelet and the controllers, of the API server, of client-go, of logging, and
		// one new in the default minor.
		head + "featureGates: {InPlacePodVerticalScaling: true, WatchList: true, ContextualLogging: true, CompositePodGroup: true}\n",
		head + "kubelet: {featureGates: {LoggingBetaOptions: true}}\nkubeProxy: {featureGates: {InPlacePodVerticalScaling: true}}\n",
	} {
		if _, _, err := Parse([]byte(doc)); err != nil {
			t.Errorf("Parse(%q) = %v", doc, err)
		}
	}
}
