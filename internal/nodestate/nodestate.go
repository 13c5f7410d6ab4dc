// Package nodestate persists what the bootstrapper must remember across restarts: whether this node
// initialized or joined a cluster, which cluster, and how far init got. The file is written
// atomically (temporary file, fsync, rename) with mode 0600 and holds no secrets.
package nodestate

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/spf13/afero"
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
	if err := s.fs.MkdirAll(filepath.Dir(s.path), 0o700); err != nil {
		return fmt.Errorf("creating state directory: %w", err)
	}
	tmp := s.path + ".tmp"
	f, err := s.fs.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("writing node state: %w", err)
	}
	if _, err := f.Write(append(data, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("writing node state: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("syncing node state: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("closing node state: %w", err)
	}
	if err := s.fs.Rename(tmp, s.path); err != nil {
		return fmt.Errorf("renaming node state: %w", err)
	}
	return nil
}
