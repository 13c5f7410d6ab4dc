// Package initconfig loads the cluster config file of `berth init --config` (and `berth manifests
// --config`, `berth config`, `berth mini up --config`): the versioned configuration internal/
// clusterconfig owns, or the unversioned form of earlier releases with a warning, defaulted and
// validated, with the files it names resolved against the config file's directory and the init
// secret read.
package initconfig

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/berth-k8s/berth/internal/clusterconfig"
)

// Config is the file `berth init --config` reads, defaulted and validated, with the paths it names
// resolved.
type Config = clusterconfig.ClusterConfiguration

// ErrInitSecret wraps every problem with the init secret.
var ErrInitSecret = errors.New("init secret")

// Read reads the config file at path, defaulted and validated, without its init secret, and
// resolves the files it names (attestation, join and image policy, init secret) against path's
// directory. An unknown field, a wrong type or an invalid value is an error naming the field's
// path (clusterconfig.ErrInvalid). The warnings say what the operator should change (an
// unversioned file).
func Read(path string) (Config, []string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, nil, fmt.Errorf("reading config: %w", err)
	}
	cfg, warnings, err := clusterconfig.Parse(data)
	if err != nil {
		return cfg, warnings, fmt.Errorf("config %s: %w", path, err)
	}
	for _, p := range []*string{&cfg.InitSecretFile, &cfg.Policies.AttestationPolicyFile, &cfg.Policies.JoinPolicyFile, &cfg.Policies.ImagePolicyFile} {
		*p = resolve(path, *p)
	}
	return cfg, warnings, nil
}

// Load reads the config file at path like Read and returns the init secret it holds or names
// (at least 16 bytes, hex-encoded).
func Load(path string) (Config, []byte, []string, error) {
	cfg, warnings, err := Read(path)
	if err != nil {
		return cfg, nil, warnings, err
	}
	secretHex := strings.TrimSpace(cfg.InitSecret)
	switch {
	case cfg.InitSecret != "" && cfg.InitSecretFile != "":
		return cfg, nil, warnings, fmt.Errorf("config %s: %w: set initSecret or initSecretFile, not both", path, ErrInitSecret)
	case cfg.InitSecretFile != "":
		raw, err := os.ReadFile(cfg.InitSecretFile)
		if err != nil {
			return cfg, nil, warnings, fmt.Errorf("reading init secret file: %w", err)
		}
		secretHex = strings.TrimSpace(string(raw))
	case secretHex == "":
		return cfg, nil, warnings, fmt.Errorf("config %s: %w: no initSecretFile", path, ErrInitSecret)
	}
	secret, err := hex.DecodeString(secretHex)
	if err != nil || len(secret) < 16 {
		return cfg, nil, warnings, fmt.Errorf("config %s: %w: it must be at least 16 bytes, hex-encoded", path, ErrInitSecret)
	}
	return cfg, secret, warnings, nil
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
