package mini

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/api/equality"

	"github.com/berth-k8s/berth/internal/clusterconfig"
	"github.com/berth-k8s/berth/internal/initconfig"
)

// TestInitConfigRoundTrips: the config mini writes for berth init reads back, through berth init's
// own loader, as the values mini meant, for both attestation variants, with and without the
// operator's configuration (berth mini up --config) under it.
func TestInitConfigRoundTrips(t *testing.T) {
	operator := filepath.Join(t.TempDir(), "cluster.yaml")
	if err := os.WriteFile(operator, []byte("apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\n"+
		"kubelet: {maxPods: 42}\nkubeProxy: {mode: iptables}\napiServer: {certSANs: [api.example.com], audit: {policy: {rules: [{level: Metadata}]}}}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, variant := range []string{AttestationTPM, AttestationInsecureNone} {
		for _, clusterConfig := range []string{"", operator} {
			cfg := testConfig(filepath.Join(t.TempDir(), "cluster"))
			cfg.Attestation = variant
			cfg.ClusterConfigFile = clusterConfig
			if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
				t.Fatal(err)
			}
			cl := &Cluster{cfg: cfg}
			path := filepath.Join(cfg.Dir, "init.yaml")
			initCfg, err := cl.initConfig()
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, initCfg, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(cl.initSecretPath(), []byte("00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			got, secret, warnings, err := initconfig.Load(path)
			if err != nil {
				t.Fatalf("%s: Load = %v\n%s", variant, err, initCfg)
			}
			if len(secret) != 16 || len(warnings) != 0 {
				t.Errorf("%s: init secret of %d bytes, want 16; warnings %q", variant, len(secret), warnings)
			}
			want := clusterconfig.Default()
			want.ClusterName = cfg.Name
			want.KubernetesVersion = cfg.Release().Kubernetes
			want.Networking = clusterconfig.Networking{ServiceSubnet: cfg.ServiceCIDR.Masked().String(), PodSubnet: cfg.PodCIDR.Masked().String()}
			want.APIServer.CertSANs = []string{cfg.HostAddr().String()}
			want.InitSecretFile = cl.initSecretPath()
			if clusterConfig != "" {
				op, err := ReadClusterConfig(clusterConfig)
				if err != nil {
					t.Fatal(err)
				}
				want.Kubelet, want.KubeProxy, want.APIServer.Audit = op.Kubelet, op.KubeProxy, op.APIServer.Audit
				want.APIServer.CertSANs = []string{"api.example.com", cfg.HostAddr().String()}
			}
			if variant == AttestationTPM {
				want.Policies.AttestationPolicyFile = cfg.PolicyPath()
				want.Policies.JoinPolicyFile = cfg.ImageJoinPolicyPath()
			}
			if !equality.Semantic.DeepEqual(got, want) {
				t.Errorf("%s: read back\n%+v\nwant\n%+v\nfrom:\n%s", variant, got, want, initCfg)
			}
		}
	}
}

// TestReadClusterConfigRefuses: berth mini up --config refuses a malformed configuration, and one
// that sets what the mini cluster decides, naming the field.
func TestReadClusterConfigRefuses(t *testing.T) {
	dir := t.TempDir()
	const head = "apiVersion: config.berth.dev/v1alpha1\nkind: ClusterConfiguration\n"
	for name, tc := range map[string]struct{ doc, want string }{
		"unknown field": {head + "kubelet: {maxPodz: 1}\n", `unknown field "kubelet.maxPodz"`},
		"PodSecurity":   {head + "apiServer: {admission: {plugins: [{name: PodSecurity, configuration: {}}]}}\n", "apiServer.admission.plugins[0].name: Forbidden"},
		"version":       {head + "kubernetesVersion: v1.2.3\n", "kubernetesVersion: the mini cluster runs"},
		"networking":    {head + "networking: {podSubnet: 10.1.0.0/16}\n", "networking: the mini cluster chooses its own networks"},
	} {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		if err := os.WriteFile(path, []byte(tc.doc), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := ReadClusterConfig(path); !errors.Is(err, ErrClusterConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: ReadClusterConfig = %v, want an error containing %q", name, err, tc.want)
		}
	}
}
