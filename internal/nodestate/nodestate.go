// Package nodestate persists what the bootstrapper must remember across restarts: whether this node
// initialized or joined a cluster, which cluster, and how far init got. The file is written
// atomically (temporary file, fsync, rename) with mode 0600 and holds no secrets.
package nodestate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"slices"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

// Role records how the node became part of a cluster.
type Role string

// Roles.
const (
	RoleInit Role = "init"
	RoleJoin Role = "join"
)

// State is the persisted node state.
type State struct {
	// Role is how the node entered the cluster.
	Role Role `json:"role"`
	// ClusterID is the hex cluster ID the node was locked to.
	ClusterID string `json:"clusterID"`
	// NodeName is the node's Kubernetes name.
	NodeName string `json:"nodeName,omitempty"`
	// CompletedPhases lists init or join phases that finished, in order.
	CompletedPhases []string `json:"completedPhases,omitempty"`
	// Done is true once init or join finished completely.
	Done bool `json:"done"`
}

// Completed reports whether phase finished.
func (s *State) Completed(phase string) bool { return slices.Contains(s.CompletedPhases, phase) }

// Store reads and writes the state file.
type Store struct {
	fs   afero.Fs
	path string
}

// NewStore returns a store for path on fsys.
func NewStore(fsys afero.Fs, path string) *Store { return &Store{fs: fsys, path: path} }

// Load returns the state, or (nil, nil) if there is none.
func (s *Store) Load() (*State, error) {
	data, err := afero.ReadFile(s.fs, s.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading node state: %w", err)
	}
	var st State
	if err := json.Unmarshal(data, &st); err != nil {
		return nil, fmt.Errorf("parsing node state %s: %w", s.path, err)
	}
	return &st, nil
}

// Save writes st durably.
func (s *Store) Save(st *State) error {
	data, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding node state: %w", err)
	}
	if err := atomicfile.Write(s.fs, s.path, append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("saving node state: %w", err)
	}
	return nil
}
