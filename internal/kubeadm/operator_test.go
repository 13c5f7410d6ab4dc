package kubeadm

import (
	"slices"
	"strings"
	"testing"

	kubeproxyv1alpha1 "k8s.io/kube-proxy/config/v1alpha1"
	kubeletv1beta1 "k8s.io/kubelet/config/v1beta1"
	"k8s.io/kubernetes/cmd/kubeadm/app/apis/kubeadm/v1beta4"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/clusterconfig"
)

const operatorConfig = `apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
apiServer:
  certSANs: [api.example.com]
  extraArgs: [{name: max-requests-inflight, value: "800"}]
  extraVolumes: [{name: extra, hostPath: /srv/extra, mountPath: /srv/extra, readOnly: true, pathType: Directory}]
  audit: {policy: {rules: [{level: Metadata}]}, logPath: /var/log/kubernetes/audit/audit.log, maxAge: 7}
  oidc: {issuerURL: "https://issuer.example.com", clientID: kubernetes, requiredClaims: {hd: example.com}}
  admission: {enablePlugins: [EventRateLimit], disablePlugins: [DefaultStorageClass]}
controllerManager: {extraArgs: [{name: node-monitor-grace-period, value: 50s}]}
scheduler: {extraVolumes: [{name: sched, hostPath: /srv/s, mountPath: /srv/s}]}
featureGates: {InPlacePodVerticalScaling: true, WatchList: false}
patches: [{target: kube-apiserver, type: merge, patch: "metadata: {annotations: {a: b}}"}]
kubelet: {maxPods: 42, failSwapOn: true}
kubeProxy: {mode: iptables}
`

func operatorParams(t *testing.T) InitParams {
	t.Helper()
	c, _, err := clusterconfig.Parse([]byte(operatorConfig))
	if err != nil {
		t.Fatal(err)
	}
	p := validInit()
	p.Cluster = &c
	p.AuditPolicyFile = "/etc/kubernetes/berth/audit-policy.yaml"
	p.AdmissionConfigFile = "/etc/kubernetes/berth/admission.yaml"
	p.PatchesDir = "/var/lib/berth/patches"
	return p
}

func args(c v1beta4.ControlPlaneComponent) map[string][]string {
	m := map[string][]string{}
	for _, a := range c.ExtraArgs {
		m[a.Name] = append(m[a.Name], a.Value)
	}
	return m
}

// TestInitConfigOperator: every part of the operator's configuration reaches kubeadm's, as
// kubeadm's, the kubelet's and kube-proxy's own types read it, next to Berth's own settings.
func TestInitConfigOperator(t *testing.T) {
	out, err := InitConfig(operatorParams(t))
	if err != nil {
		t.Fatal(err)
	}
	docs := strings.Split(string(out), "---\n")
	if len(docs) != 4 {
		t.Fatalf("got %d documents, want 4:\n%s", len(docs), out)
	}
	var initCfg v1beta4.InitConfiguration
	var cc v1beta4.ClusterConfiguration
	var kubelet kubeletv1beta1.KubeletConfiguration
	var proxy kubeproxyv1alpha1.KubeProxyConfiguration
	for i, v := range []any{&initCfg, &cc, &kubelet, &proxy} {
		if err := yaml.UnmarshalStrict([]byte(docs[i]), v); err != nil {
			t.Fatalf("document %d: %v\n%s", i, err, docs[i])
		}
	}
	if initCfg.Patches == nil || initCfg.Patches.Directory != "/var/lib/berth/patches" {
		t.Errorf("patches = %+v", initCfg.Patches)
	}
	api := args(cc.APIServer.ControlPlaneComponent)
	for name, want := range map[string]string{
		"max-requests-inflight": "800", "enable-aggregator-routing": "true", "admission-control-config-file": "/etc/kubernetes/berth/admission.yaml",
		"audit-policy-file": "/etc/kubernetes/berth/audit-policy.yaml", "audit-log-path": "/var/log/kubernetes/audit/audit.log",
		"audit-log-maxage": "7", "audit-log-maxbackup": "10", "audit-log-maxsize": "100",
		"oidc-issuer-url": "https://issuer.example.com", "oidc-client-id": "kubernetes", "oidc-username-claim": "sub", "oidc-required-claim": "hd=example.com",
		"enable-admission-plugins": "NodeRestriction,EventRateLimit", "disable-admission-plugins": "DefaultStorageClass",
		"feature-gates": "InPlacePodVerticalScaling=true,WatchList=false",
	} {
		if !slices.Equal(api[name], []string{want}) {
			t.Errorf("kube-apiserver --%s = %q, want %q", name, api[name], want)
		}
	}
	if cm := args(cc.ControllerManager); !slices.Equal(cm["node-monitor-grace-period"], []string{"50s"}) || !slices.Equal(cm["feature-gates"], []string{"InPlacePodVerticalScaling=true,WatchList=false"}) {
		t.Errorf("kube-controller-manager flags = %v", cm)
	}
	if s := args(cc.Scheduler); !slices.Equal(s["feature-gates"], []string{"InPlacePodVerticalScaling=true,WatchList=false"}) || len(cc.Scheduler.ExtraVolumes) != 1 {
		t.Errorf("kube-scheduler = %+v", cc.Scheduler)
	}
	mounts := map[string]v1beta4.HostPathMount{}
	for _, v := range cc.APIServer.ExtraVolumes {
		mounts[v.MountPath] = v
	}
	if v := mounts["/etc/kubernetes/berth"]; !v.ReadOnly {
		t.Errorf("the admission and audit policy directory is not mounted read-only: %+v", cc.APIServer.ExtraVolumes)
	}
	if v := mounts["/var/log/kubernetes/audit"]; v.ReadOnly || v.Name != "berth-audit-log" {
		t.Errorf("the audit log directory is not mounted writable: %+v", cc.APIServer.ExtraVolumes)
	}
	if v := mounts["/srv/extra"]; !v.ReadOnly || v.PathType != "Directory" {
		t.Errorf("the operator's volume: %+v", cc.APIServer.ExtraVolumes)
	}
	if !slices.Equal(cc.APIServer.CertSANs, []string{"198.51.100.10", "api.example.com"}) {
		t.Errorf("certSANs = %v", cc.APIServer.CertSANs)
	}
	if kubelet.MaxPods != 42 || kubelet.FailSwapOn == nil || !*kubelet.FailSwapOn || kubelet.FailCgroupV1 == nil || *kubelet.FailCgroupV1 ||
		kubelet.CgroupDriver != "cgroupfs" || !kubelet.RotateCertificates || !kubelet.ServerTLSBootstrap || !kubelet.FeatureGates["InPlacePodVerticalScaling"] {
		t.Errorf("kubelet configuration:\n%s", docs[2])
	}
	if proxy.Mode != "iptables" || proxy.Conntrack.MaxPerCore == nil || *proxy.Conntrack.MaxPerCore != 0 || proxy.FeatureGates["WatchList"] || len(proxy.FeatureGates) != 2 {
		t.Errorf("kube-proxy configuration (the operator's mode, the node's conntrack setting):\n%s", docs[3])
	}
}

// TestInitConfigOperatorNeedsFiles: audit and patches need the files the node wrote.
func TestInitConfigOperatorNeedsFiles(t *testing.T) {
	p := operatorParams(t)
	p.AuditPolicyFile = "audit.yaml"
	if _, err := InitConfig(p); err == nil || !strings.Contains(err.Error(), "audit policy file") {
		t.Errorf("relative audit policy file: %v", err)
	}
	p = operatorParams(t)
	p.PatchesDir = ""
	if _, err := InitConfig(p); err == nil || !strings.Contains(err.Error(), "patches directory") {
		t.Errorf("no patches directory: %v", err)
	}
}

// TestPatchFiles: one file per patch, in order, named as kubeadm reads them.
func TestPatchFiles(t *testing.T) {
	files := PatchFiles([]clusterconfig.Patch{{Target: "etcd", Type: "json", Patch: "[]"}, {Target: "kube-apiserver", Type: "strategic", Patch: "a: b"}})
	if len(files) != 2 || string(files["etcd000+json.yaml"]) != "[]" || string(files["kube-apiserver001+strategic.yaml"]) != "a: b" {
		t.Errorf("PatchFiles = %q", files)
	}
}
