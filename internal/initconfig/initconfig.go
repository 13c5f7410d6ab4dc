// Package initconfig owns the cluster config file `berth init --config` reads (and `berth
// manifests --config`, `berth mini` writes): its typed form, its defaults, and loading it with the
// files it names resolved against the config file's directory.
package initconfig

import (
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/k8sversion"
)

// Config is the file `berth init --config` reads.
type Config struct {
	ClusterName       string   `json:"clusterName"`
	KubernetesVersion string   `json:"kubernetesVersion"`
	ServiceCIDR       string   `json:"serviceCIDR"`
	PodCIDR           string   `json:"podCIDR"`
	APIServerCertSANs []string `json:"apiServerCertSANs,omitempty"`
	// InitSecret is the node's init secret, hex; InitSecretFile names a file holding it instead.
	InitSecret     string `json:"initSecret,omitempty"`
	InitSecretFile string `json:"initSecretFile,omitempty"`
	// AttestationPolicyFile names the cluster's attestation policy (YAML) for the joinservice.
	AttestationPolicyFile string `json:"attestationPolicyFile,omitempty"`
	// JoinPolicyFile names the join policy (YAML) joining nodes check the joinservice against; init
	// writes it, with the cluster's attestation-key CA added, to the workspace's join-policy.yaml.
	JoinPolicyFile string     `json:"joinPolicyFile,omitempty"`
	Components     Components `json:"components,omitempty"`
}

// Components are the choices about the cluster's own components.
type Components struct {
	SkipKubeProxy   bool   `json:"skipKubeProxy,omitempty"`
	SkipCoreDNS     bool   `json:"skipCoreDNS,omitempty"`
	ImagePolicyFile string `json:"imagePolicyFile,omitempty"`
}

// Default is the config a file's missing fields take.
func Default() Config {
	return Config{ClusterName: "berth", KubernetesVersion: k8sversion.Default().Kubernetes, ServiceCIDR: "10.96.0.0/12", PodCIDR: "10.244.0.0/16"}
}

// Marshal returns c as the YAML Read and Load read back.
func Marshal(c Config) ([]byte, error) {
	return yaml.Marshal(c)
}

// Read reads the config file at path over the defaults, without its init secret, and resolves the
// files it names (attestation, join and image policy, init secret) against path's directory. An
// unknown field is an error.
func Read(path string) (Config, error) {
	cfg := Default()
	data, err := os.ReadFile(path)
	if err != nil {
		return cfg, fmt.Errorf("reading config: %w", err)
	}
	if err := yaml.UnmarshalStrict(data, &cfg); err != nil {
		return cfg, fmt.Errorf("parsing config %s: %w", path, err)
	}
	for _, p := range []*string{&cfg.InitSecretFile, &cfg.AttestationPolicyFile, &cfg.JoinPolicyFile, &cfg.Components.ImagePolicyFile} {
		*p = resolve(path, *p)
	}
	return cfg, nil
}

// Load reads the config file at path like Read and returns the init secret it holds or names
// (at least 16 bytes, hex-encoded).
func Load(path string) (Config, []byte, error) {
	cfg, err := Read(path)
	if err != nil {
		return cfg, nil, err
	}
	secretHex := strings.TrimSpace(cfg.InitSecret)
	switch {
	case cfg.InitSecret != "" && cfg.InitSecretFile != "":
		return cfg, nil, fmt.Errorf("config %s: set initSecret or initSecretFile, not both", path)
	case cfg.InitSecretFile != "":
		raw, err := os.ReadFile(cfg.InitSecretFile)
		if err != nil {
			return cfg, nil, fmt.Errorf("reading init secret file: %w", err)
		}
		secretHex = strings.TrimSpace(string(raw))
	case secretHex == "":
		return cfg, nil, fmt.Errorf("config %s: no initSecret or initSecretFile", path)
	}
	secret, err := hex.DecodeString(secretHex)
	if err != nil || len(secret) < 16 {
		return cfg, nil, fmt.Errorf("config %s: the init secret must be at least 16 bytes, hex-encoded", path)
	}
	return cfg, secret, nil
}

// ReadFile reads a file the config names (a path Read resolved); nothing for "".
func ReadFile(path string) ([]byte, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return data, nil
}

// resolve interprets p relative to the directory of the config file base; "" stays "".
func resolve(base, p string) string {
	if p == "" || filepath.IsAbs(p) {
		return p
	}
	return filepath.Join(filepath.Dir(base), p)
}
