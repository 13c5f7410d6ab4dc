package initserver

import (
	"strings"
	"testing"

	"github.com/berth-k8s/berth/internal/clusterconfig"
)

// TestParseRequestClusterConfig: the request's cluster configuration is decoded strictly and
// validated, must agree with the request's own fields, and an older CLI's request without one
// gets the defaults under its fields.
func TestParseRequestClusterConfig(t *testing.T) {
	const head = "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\n"
	req := request(1)
	req.ClusterConfig = []byte(head + "kubelet: {maxPods: 42}\nkubeProxy: {mode: iptables}\n")
	parsed, err := parseRequest(req)
	if err != nil {
		t.Fatal(err)
	}
	if parsed.Cluster.Kubelet == nil || parsed.Cluster.Kubelet.MaxPods != 42 || parsed.Cluster.KubeProxy.Mode != "iptables" {
		t.Errorf("Cluster = %+v", parsed.Cluster)
	}
	old, err := parseRequest(request(1))
	if err != nil {
		t.Fatal(err)
	}
	want := clusterconfig.Default()
	if old.Cluster.ClusterName != "berth" || old.Cluster.Networking != want.Networking || old.Cluster.APIVersion != clusterconfig.APIVersion {
		t.Errorf("Cluster without cluster_config = %+v", old.Cluster)
	}
	for name, tc := range map[string]struct{ doc, want string }{
		"unknown field":    {head + "kubelet: {maxPodz: 1}\n", `cluster_config: invalid cluster configuration: unknown field "kubelet.maxPodz"`},
		"PodSecurity":      {head + "apiServer: {admission: {plugins: [{name: PodSecurity, configuration: {}}]}}\n", "apiServer.admission.plugins[0].name: Forbidden"},
		"other name":       {head + "clusterName: other\n", `cluster_config: clusterName "other" is not the request's "berth"`},
		"other pod subnet": {head + "networking: {podSubnet: 10.1.0.0/16}\n", "networking.podSubnet"},
		"other SANs":       {head + "apiServer: {certSANs: [192.0.2.1]}\n", "apiServer.certSANs"},
		"other components": {head + "components: {skipCoreDNS: true}\n", "components are not the request's"},
	} {
		req := request(1)
		req.ClusterConfig = []byte(tc.doc)
		if _, err := parseRequest(req); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: parseRequest = %v, want %q", name, err, tc.want)
		}
	}
}
