// Package static is a metadata provider that reads everything from one YAML or JSON file, for
// machines whose platform has no metadata service.
package static

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"sync"

	"github.com/spf13/afero"
	"sigs.k8s.io/yaml"

	"github.com/berth-k8s/berth/internal/metadata"
)

// File is the static metadata file's format.
type File struct {
	Self                 metadata.Instance   `json:"self"`
	Peers                []metadata.Instance `json:"peers,omitempty"`
	ControlPlaneEndpoint string              `json:"controlPlaneEndpoint,omitempty"`
	// InitSecretHash is the hex SHA-256 of the init secret.
	InitSecretHash string `json:"initSecretHash,omitempty"`
}

// Provider answers metadata queries from a File. The file is re-read on every call, so an operator
// may fill in the control-plane endpoint while the daemon runs; it is parsed again only when its
// content changed (the joinservice asks on every join).
type Provider struct {
	fs   afero.Fs
	path string

	mu      sync.Mutex
	lastRaw []byte
	last    File
}

// New returns a provider reading path on fsys.
func New(fsys afero.Fs, path string) *Provider { return &Provider{fs: fsys, path: path} }

func (p *Provider) load() (File, error) {
	data, err := afero.ReadFile(p.fs, p.path)
	if err != nil {
		return File{}, fmt.Errorf("reading metadata file: %w", err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lastRaw != nil && bytes.Equal(data, p.lastRaw) {
		return p.last, nil
	}
	var f File
	if err := yaml.UnmarshalStrict(data, &f); err != nil {
		return File{}, fmt.Errorf("parsing metadata file %s: %w", p.path, err)
	}
	if err := f.Self.Validate(); err != nil {
		return File{}, fmt.Errorf("metadata file %s: self: %w", p.path, err)
	}
	p.lastRaw, p.last = data, f
	return f, nil
}

// Self returns this instance.
func (p *Provider) Self(context.Context) (metadata.Instance, error) {
	f, err := p.load()
	return f.Self, err
}

// Peers returns every instance of the cluster, this one included.
func (p *Provider) Peers(context.Context) ([]metadata.Instance, error) {
	f, err := p.load()
	if err != nil {
		return nil, err
	}
	peers := append([]metadata.Instance{f.Self}, f.Peers...)
	return peers, nil
}

// ControlPlaneEndpoint returns HOST:PORT of the Kubernetes API server, or ErrNotFound.
func (p *Provider) ControlPlaneEndpoint(context.Context) (string, error) {
	f, err := p.load()
	if err != nil {
		return "", err
	}
	if f.ControlPlaneEndpoint == "" {
		return "", fmt.Errorf("control-plane endpoint: %w", metadata.ErrNotFound)
	}
	return f.ControlPlaneEndpoint, nil
}

// InitSecretHash returns the SHA-256 of the init secret, or ErrNotFound.
func (p *Provider) InitSecretHash(context.Context) ([]byte, error) {
	f, err := p.load()
	if err != nil {
		return nil, err
	}
	if f.InitSecretHash == "" {
		return nil, fmt.Errorf("init secret hash: %w", metadata.ErrNotFound)
	}
	h, err := hex.DecodeString(f.InitSecretHash)
	if err != nil || len(h) != 32 {
		return nil, fmt.Errorf("metadata file %s: initSecretHash is not 64 hex digits", p.path)
	}
	return h, nil
}
