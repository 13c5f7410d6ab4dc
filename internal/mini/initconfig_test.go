package mini

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"

	"github.com/berth-k8s/berth/internal/initconfig"
	"github.com/berth-k8s/berth/internal/k8sversion"
)

// TestInitConfigRoundTrips: the config mini writes for berth init reads back, through berth init's
// own loader, as the values mini meant, for both attestation variants; the Kubernetes version is the
// cluster's (the default when it names none).
func TestInitConfigRoundTrips(t *testing.T) {
	for variant, version := range map[string]string{AttestationTPM: "v1.36.3", AttestationInsecureNone: ""} {
		cfg := testConfig(filepath.Join(t.TempDir(), "cluster"))
		cfg.Attestation = variant
		cfg.KubernetesVersion = version
		wantVersion := version
		if version == "" {
			wantVersion = k8sversion.Default().Kubernetes
		}
		if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
			t.Fatal(err)
		}
		cl := &Cluster{cfg: cfg}
		path := filepath.Join(cfg.Dir, "init.yaml")
		if err := os.WriteFile(path, cl.initConfig(), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(cl.initSecretPath(), []byte("00112233445566778899aabbccddeeff\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		got, secret, err := initconfig.Load(path)
		if err != nil {
			t.Fatalf("%s: Load = %v\n%s", variant, err, cl.initConfig())
		}
		if len(secret) != 16 {
			t.Errorf("%s: init secret of %d bytes, want 16", variant, len(secret))
		}
		want := initconfig.Config{
			ClusterName:       cfg.Name,
			KubernetesVersion: wantVersion,
			ServiceCIDR:       cfg.ServiceCIDR.Masked().String(),
			PodCIDR:           cfg.PodCIDR.Masked().String(),
			APIServerCertSANs: []string{cfg.HostAddr().String()},
			InitSecretFile:    cl.initSecretPath(),
		}
		if variant == AttestationTPM {
			want.AttestationPolicyFile = cfg.PolicyPath()
			want.JoinPolicyFile = cfg.ImageJoinPolicyPath()
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: read back\n%+v\nwant\n%+v\nfrom:\n%s", variant, got, want, cl.initConfig())
		}
	}
}
