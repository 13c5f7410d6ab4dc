package berthsystem_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"k8s.io/pod-security-admission/admission/api/load"
	psaapi "k8s.io/pod-security-admission/api"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/berthsystem"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/internal/records"
)

const testJoinServiceImage = "berth.local/joinservice:v1"

func testObjects(t *testing.T, cfg berthsystem.Config) []*unstructured.Unstructured {
	t.Helper()
	cfg.JoinServiceImage = testJoinServiceImage
	objs, err := berthsystem.Objects(cfg, berthsystem.Cluster{
		Secrets: joinconfig.ClusterSecrets{MasterSecret: bytes.Repeat([]byte{1}, 32), Salt: bytes.Repeat([]byte{2}, 32)},
		Join:    joinconfig.Config{AttestationPolicy: []byte("variant: tpm\n"), MeasurementSalt: []byte{2}, ClusterID: []byte{3}, KubernetesVersion: "v1.37.2", APIServerEndpoint: "198.51.100.10:6443"},
	})
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// find decodes the object of kind and name from objs into out.
func find(t *testing.T, objs []*unstructured.Unstructured, kind, name string, out any) {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, out); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("no %s %s among the objects", kind, name)
}

func TestObjectsNeedImage(t *testing.T) {
	if _, err := berthsystem.Objects(berthsystem.Config{}, berthsystem.Cluster{}); !errors.Is(err, berthsystem.ErrNoJoinServiceImage) {
		t.Fatalf("Objects() without an image = %v, want %v", err, berthsystem.ErrNoJoinServiceImage)
	}
}

// TestObjectsOrder: what others refer to comes first (the namespace, the RuntimeClass, the guards
// before any pod), the DaemonSet last.
func TestObjectsOrder(t *testing.T) {
	var kinds []string
	for _, o := range testObjects(t, berthsystem.Config{}) {
		kinds = append(kinds, o.GetKind()+"/"+o.GetName())
	}
	want := []string{
		"Namespace/berth-system", "RuntimeClass/berth-host",
		"ValidatingAdmissionPolicy/berth-system-images", "ValidatingAdmissionPolicyBinding/berth-system-images",
		"ValidatingAdmissionPolicy/berth-host-runtime", "ValidatingAdmissionPolicyBinding/berth-host-runtime",
		"ValidatingAdmissionPolicy/berth-node-revocation", "ValidatingAdmissionPolicyBinding/berth-node-revocation",
		"Secret/berth-cluster-secrets", "ConfigMap/berth-join-config",
		"CustomResourceDefinition/machines.records.berth.dev", "CustomResourceDefinition/joinrecords.records.berth.dev",
		"ConfigMap/berth-join-ledger",
		"ConfigMap/berth-machines", "Lease/berth-control-plane-slot", "Lease/berth-cert-keeper",
		"ConfigMap/berth-backup", "Lease/berth-backup", "ServiceAccount/berth-joinservice", "Role/berth:joinservice",
		"RoleBinding/berth:joinservice", "Role/berth:joinservice:cluster-config", "RoleBinding/berth:joinservice:cluster-config",
		"ClusterRole/berth:joinservice:kubelet-serving-approver",
		"ClusterRoleBinding/berth:joinservice:kubelet-serving-approver",
		"ClusterRole/berth:joinservice:webhook-spread", "ClusterRoleBinding/berth:joinservice:webhook-spread",
		"DaemonSet/berth-joinservice",
	}
	if !slices.Equal(kinds, want) {
		t.Fatalf("objects\n%v\nwant\n%v", kinds, want)
	}
}

// TestNamespacePodSecurity: berth-system enforces, audits and warns at restricted, pinned to the
// cluster's minor version.
func TestNamespacePodSecurity(t *testing.T) {
	var ns corev1.Namespace
	find(t, testObjects(t, berthsystem.Config{}), "Namespace", joinconfig.Namespace, &ns)
	for _, mode := range []string{"enforce", "audit", "warn"} {
		if got := ns.Labels["pod-security.kubernetes.io/"+mode]; got != "restricted" {
			t.Errorf("%s = %q, want restricted", mode, got)
		}
		if got := ns.Labels["pod-security.kubernetes.io/"+mode+"-version"]; got != "v1.37" {
			t.Errorf("%s-version = %q, want v1.37", mode, got)
		}
	}
	if _, err := psaapi.ParseVersion(ns.Labels[psaapi.EnforceVersionLabel]); err != nil {
		t.Errorf("the enforce version does not parse: %v", err)
	}
	// Every supported release pins its own minor, one the Pod Security library parses.
	for _, r := range k8sversion.Supported() {
		got := berthsystem.Namespace(r.Kubernetes).Labels[psaapi.EnforceVersionLabel]
		if got != r.Minor() {
			t.Errorf("enforce-version at %s = %q, want %s", r, got, r.Minor())
		}
		if _, err := psaapi.ParseVersion(got); err != nil {
			t.Errorf("enforce-version at %s does not parse: %v", r, err)
		}
	}
	if got := berthsystem.Namespace("").Labels[psaapi.EnforceVersionLabel]; got != "latest" {
		t.Errorf("enforce-version without a Kubernetes version = %q, want latest", got)
	}
}

// TestJoinServiceRoleNarrow: every rule but the Events' and the webhook pods' names the objects it
// covers, and nothing but Events, evictions and the record API's objects may be created (creating cannot be limited to a name).
// The webhook's pods have generated names: the spread keeper (joinservice/spread) reads them and
// evicts one through the eviction API, so that the webhook's disruption budget decides.
func TestJoinServiceRoleNarrow(t *testing.T) {
	var role rbacv1.Role
	find(t, testObjects(t, berthsystem.Config{}), "Role", "berth:joinservice", &role)
	covered := map[string][]string{}
	for _, r := range role.Rules {
		// The record API keeps one object per machine and per refused key (internal/records): those
		// cannot be named, so the joinservice creates and prunes them, and nothing else of the group.
		if slices.Equal(r.APIGroups, []string{records.Group}) {
			if !slices.Equal(r.Resources, []string{records.MachinePlural, records.JoinRecordPlural}) || slices.Contains(r.Verbs, "*") {
				t.Errorf("rule %+v reaches beyond the record API's machines and join records", r)
			}
			continue
		}
		unnamed := slices.Equal(r.Resources, []string{"events"}) || slices.Equal(r.Resources, []string{"pods"}) ||
			slices.Equal(r.Resources, []string{"pods/eviction"})
		if slices.Contains(r.Verbs, "create") && !slices.Equal(r.Resources, []string{"events"}) && !slices.Equal(r.Resources, []string{"pods/eviction"}) {
			t.Errorf("rule %+v creates %v", r, r.Resources)
		}
		if slices.Contains(r.Verbs, "*") || slices.Contains(r.Resources, "*") || slices.Contains(r.Verbs, "delete") {
			t.Errorf("rule %+v is too wide", r)
		}
		if unnamed {
			if slices.ContainsFunc(r.Verbs, func(v string) bool { return v != "get" && v != "list" && v != "create" && v != "patch" }) {
				t.Errorf("rule %+v may change or watch objects it cannot name", r)
			}
			continue
		}
		if len(r.ResourceNames) == 0 {
			t.Errorf("rule %+v names no object", r)
		}
		for _, res := range r.Resources {
			covered[res] = append(covered[res], r.ResourceNames...)
		}
	}
	want := map[string][]string{
		"secrets":     {joinconfig.SecretName, joinconfig.BackupStoreSecretName},
		"configmaps":  {joinconfig.JoinConfigName, joinconfig.JoinLedgerName, joinconfig.MachinesName, kmsstate.ConfigMapName, joinconfig.BackupName},
		"leases":      {joinconfig.ControlPlaneSlotLease, joinconfig.CertKeeperLease, joinconfig.BackupName},
		"deployments": {"berth-webhook"},
	}
	for res, names := range want {
		got := slices.Sorted(slices.Values(covered[res]))
		if !slices.Equal(got, slices.Sorted(slices.Values(names))) {
			t.Errorf("%s: the Role names %v, want %v", res, got, names)
		}
	}
}

// TestJoinServicePodSecurity: the joinservice's pods carry the exempt RuntimeClass, the default
// seccomp profile and requests; the container drops every capability, cannot escalate and has a
// read-only root, unless a TPM device makes it privileged (then only what a privileged container
// allows).
func TestJoinServicePodSecurity(t *testing.T) {
	for name, tc := range map[string]struct {
		hostPaths  []string
		privileged bool
	}{
		"tpm socket": {hostPaths: []string{"/run/swtpm"}},
		"tpm device": {hostPaths: []string{"/dev/tpmrm0"}, privileged: true},
	} {
		t.Run(name, func(t *testing.T) {
			var ds appsv1.DaemonSet
			find(t, testObjects(t, berthsystem.Config{JoinServiceHostPaths: tc.hostPaths}), "DaemonSet", joinconfig.JoinServiceName, &ds)
			pod := ds.Spec.Template.Spec
			if pod.RuntimeClassName == nil || *pod.RuntimeClassName != berthsystem.HostRuntimeClass {
				t.Errorf("runtimeClassName = %v, want %s", pod.RuntimeClassName, berthsystem.HostRuntimeClass)
			}
			if sp := pod.SecurityContext.SeccompProfile; sp == nil || sp.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Errorf("seccompProfile = %+v, want RuntimeDefault", sp)
			}
			c := pod.Containers[0]
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
				t.Errorf("resources = %+v, want CPU and memory requests and a memory limit", c.Resources)
			}
			if got := c.Resources.Limits.Cpu(); got.Value() != berthsystem.JoinServiceCPUs || got.MilliValue() != 1000*berthsystem.JoinServiceCPUs {
				t.Errorf("CPU limit %v, want %d (a flood must not take the control plane's CPU)", got, berthsystem.JoinServiceCPUs)
			}
			if got := c.Resources.Limits.Memory().Value(); got != berthsystem.JoinServiceMemoryLimitBytes {
				t.Errorf("memory limit %d, want %d", got, berthsystem.JoinServiceMemoryLimitBytes)
			}
			sc := c.SecurityContext
			if *sc.Privileged != tc.privileged || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("securityContext = %+v", sc)
			}
			if !tc.privileged && (sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
				sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0) {
				t.Errorf("unprivileged securityContext = %+v, want no escalation, drop ALL, add none", sc)
			}
			if tc.privileged && (sc.AllowPrivilegeEscalation != nil || sc.Capabilities != nil) {
				t.Errorf("privileged securityContext = %+v: the API server refuses a privileged container without escalation", sc)
			}
			ports := map[string]int32{}
			for _, p := range c.Ports {
				ports[p.Name] = p.ContainerPort
			}
			if ports["join"] != joinconfig.JoinPort || ports["metrics"] != joinconfig.MetricsPort {
				t.Errorf("ports = %v", ports)
			}
		})
	}
}

// TestAdmissionConfiguration: the file the API server reads is an AdmissionConfiguration whose
// PodSecurity configuration, as PodSecurity's own loader reads it, keeps Kubernetes' defaults and
// exempts exactly the RuntimeClass.
func TestAdmissionConfiguration(t *testing.T) {
	data, err := berthsystem.AdmissionConfiguration()
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Plugins    []struct {
			Name          string          `json:"name"`
			Configuration json.RawMessage `json:"configuration"`
		} `json:"plugins"`
	}
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.APIVersion != "apiserver.config.k8s.io/v1" || cfg.Kind != "AdmissionConfiguration" || len(cfg.Plugins) != 1 || cfg.Plugins[0].Name != "PodSecurity" {
		t.Fatalf("admission configuration:\n%s", data)
	}
	psa, err := load.LoadFromData(cfg.Plugins[0].Configuration)
	if err != nil {
		t.Fatalf("PodSecurity's loader refuses the configuration: %v\n%s", err, data)
	}
	if psa.Defaults.Enforce != "privileged" || !slices.Equal(psa.Exemptions.RuntimeClasses, []string{berthsystem.HostRuntimeClass}) ||
		len(psa.Exemptions.Usernames) != 0 || len(psa.Exemptions.Namespaces) != 0 {
		t.Fatalf("PodSecurity configuration %+v", psa)
	}
	if strings.Contains(string(data), "berth-system") {
		t.Errorf("the namespace itself is exempt:\n%s", data)
	}
}

// TestAdmissionConfigurationMerges: the operator's plugin configurations follow Berth's PodSecurity,
// which stays first and unchanged; a second PodSecurity configuration is refused.
func TestAdmissionConfigurationMerges(t *testing.T) {
	limit := apiserverv1.AdmissionPluginConfiguration{Name: "EventRateLimit", Configuration: &runtime.Unknown{
		Raw: []byte(`{"apiVersion":"eventratelimit.admission.k8s.io/v1alpha1","kind":"Configuration","limits":[{"type":"Server","qps":5,"burst":10}]}`), ContentType: runtime.ContentTypeJSON}}
	data, err := berthsystem.AdmissionConfiguration(limit)
	if err != nil {
		t.Fatal(err)
	}
	base, err := berthsystem.AdmissionConfiguration()
	if err != nil {
		t.Fatal(err)
	}
	var cfg, baseCfg apiserverv1.AdmissionConfiguration
	if err := yaml.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(base, &baseCfg); err != nil {
		t.Fatal(err)
	}
	if len(cfg.Plugins) != 2 || cfg.Plugins[0].Name != "PodSecurity" || cfg.Plugins[1].Name != "EventRateLimit" ||
		!bytes.Equal(cfg.Plugins[0].Configuration.Raw, baseCfg.Plugins[0].Configuration.Raw) || !strings.Contains(string(cfg.Plugins[1].Configuration.Raw), `"qps":5`) {
		t.Errorf("merged admission configuration:\n%s", data)
	}
	override := apiserverv1.AdmissionPluginConfiguration{Name: "PodSecurity", Configuration: &runtime.Unknown{Raw: []byte(`{}`)}}
	if _, err := berthsystem.AdmissionConfiguration(limit, override); !errors.Is(err, berthsystem.ErrPodSecurityOverride) {
		t.Errorf("AdmissionConfiguration with a PodSecurity override = %v", err)
	}
}
