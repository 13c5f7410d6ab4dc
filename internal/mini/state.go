package mini

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

// State is what a cluster's state file records: its configuration and everything Down cannot
// derive from it (daemon PIDs, directories it created on the host).
type State struct {
	Config Config `json:"config"`
	// CreatedDir is true when Up created Config.Dir itself, so Down may remove it.
	CreatedDir bool `json:"createdDir"`
	// CreatedParents are the missing parents of Config.Dir that Up created, outermost first.
	CreatedParents []string `json:"createdParents,omitempty"`
	// HostDirs are mount points Up had to create on the host for the nodes' bind mounts.
	HostDirs []string `json:"hostDirs,omitempty"`
	// Agent is the host daemon serving metadata and writing CNI configs.
	Agent *Proc `json:"agent,omitempty"`
	// Procs are each node's daemons, by node name.
	Procs map[string][]Proc `json:"procs,omitempty"`
	// InitSecretHash is the hex SHA-256 of the init secret the metadata API publishes.
	InitSecretHash string `json:"initSecretHash,omitempty"`
	// ControlPlaneEndpoint is HOST:PORT of the API server once the cluster is initialized.
	ControlPlaneEndpoint string `json:"controlPlaneEndpoint,omitempty"`
}

// ErrNoState is returned by LoadState when the directory holds no state file.
var ErrNoState = errors.New("no mini cluster state")

// LoadState reads the state file of the cluster in dir.
func LoadState(dir string) (*State, error) {
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, ErrNoState
	}
	if err != nil {
		return nil, fmt.Errorf("reading state: %w", err)
	}
	var s State
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decoding state: %w", err)
	}
	if s.Procs == nil {
		s.Procs = map[string][]Proc{}
	}
	return &s, nil
}

// save writes s atomically (temporary file, fsync, rename).
func (s *State) save() error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding state: %w", err)
	}
	return atomicfile.Write(afero.NewOsFs(), s.Config.StatePath(), b, 0o600)
}

// writeFile writes b to path, creating parent directories.
func writeFile(path string, b []byte, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("creating %s: %w", filepath.Dir(path), err)
	}
	if err := os.WriteFile(path, b, mode); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}
