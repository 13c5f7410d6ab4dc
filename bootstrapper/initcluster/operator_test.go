package initcluster

import (
	"context"
	"strings"
	"testing"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/clusterconfig"
)

// TestWriteConfigOperatorFiles: the kubeadm-config phase writes what the operator's configuration
// needs on the control plane (its admission plugins merged after Berth's PodSecurity, the audit
// policy, the patches) and kubeadm's configuration names them; a re-run without patches removes
// the old ones.
func TestWriteConfigOperatorFiles(t *testing.T) {
	i, _, fsys, _ := setup("v1.34.2")
	job := newJob(t, i)
	c, _, err := clusterconfig.Parse([]byte(`apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
apiServer:
  audit: {policy: {rules: [{level: Metadata}]}}
  admission:
    enablePlugins: [EventRateLimit]
    plugins: [{name: EventRateLimit, configuration: {apiVersion: eventratelimit.admission.k8s.io/v1alpha1, kind: Configuration, limits: [{type: Server, qps: 5, burst: 10}]}}]
patches: [{target: kube-apiserver, patch: "metadata: {annotations: {a: b}}"}]
`))
	if err != nil {
		t.Fatal(err)
	}
	job.Req.Cluster = c
	ctx := context.Background()
	if err := i.writeConfig(ctx, job); err != nil {
		t.Fatal(err)
	}
	read := func(path string) string {
		data, err := afero.ReadFile(fsys, path)
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	admission := read("/etc/kubernetes/berth/admission.yaml")
	if ps, erl := strings.Index(admission, "name: PodSecurity"), strings.Index(admission, "name: EventRateLimit"); ps < 0 || erl < ps || !strings.Contains(admission, "berth-host") {
		t.Errorf("admission configuration:\n%s", admission)
	}
	if audit := read("/etc/kubernetes/berth/audit-policy.yaml"); audit != "apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n- level: Metadata\n" {
		t.Errorf("audit policy:\n%s", audit)
	}
	if patch := read("/state/kubeadm-patches/kube-apiserver000+strategic.yaml"); patch != "metadata: {annotations: {a: b}}" {
		t.Errorf("patch = %q", patch)
	}
	cfg := read("/state/kubeadm-init.yaml")
	for _, want := range []string{"value: /etc/kubernetes/berth/audit-policy.yaml", "directory: /state/kubeadm-patches", "value: NodeRestriction,EventRateLimit"} {
		if !strings.Contains(cfg, want) {
			t.Errorf("kubeadm configuration lacks %q:\n%s", want, cfg)
		}
	}
	job.Req.Cluster.Patches = nil
	if err := i.writeConfig(ctx, job); err != nil {
		t.Fatal(err)
	}
	if ok, _ := afero.Exists(fsys, "/state/kubeadm-patches"); ok {
		t.Error("the patches of an earlier attempt stay")
	}
}
