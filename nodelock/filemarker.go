package nodelock

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"

	"github.com/spf13/afero"

	"github.com/berth-k8s/berth/internal/atomicfile"
)

// FileMarker is the on-disk half of the bootstrap marker: a file holding the cluster ID, written
// with fsync and an atomic rename so that it is either absent or complete.
type FileMarker struct {
	fs   afero.Fs
	path string
}

// NewFileMarker returns a marker that writes path on fsys.
func NewFileMarker(fsys afero.Fs, path string) *FileMarker {
	return &FileMarker{fs: fsys, path: path}
}

// MarkBootstrapped writes the marker file. It refuses to overwrite an existing marker.
func (m *FileMarker) MarkBootstrapped(_ context.Context, clusterID []byte) error {
	if _, err := m.fs.Stat(m.path); err == nil {
		return fmt.Errorf("bootstrap marker %s exists already", m.path)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("checking bootstrap marker: %w", err)
	}
	if err := atomicfile.Write(m.fs, m.path, []byte(hex.EncodeToString(clusterID)+"\n"), 0o600); err != nil {
		return fmt.Errorf("writing bootstrap marker: %w", err)
	}
	return nil
}

// Bootstrapped reports whether the marker file exists.
func (m *FileMarker) Bootstrapped(context.Context) (bool, error) {
	_, err := m.fs.Stat(m.path)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	default:
		return false, fmt.Errorf("checking bootstrap marker: %w", err)
	}
}

// ClusterID returns the cluster ID recorded in the marker file.
func (m *FileMarker) ClusterID() ([]byte, error) {
	data, err := afero.ReadFile(m.fs, m.path)
	if err != nil {
		return nil, fmt.Errorf("reading bootstrap marker: %w", err)
	}
	if n := len(data); n > 0 && data[n-1] == '\n' {
		data = data[:n-1]
	}
	id, err := hex.DecodeString(string(data))
	if err != nil {
		return nil, fmt.Errorf("decoding bootstrap marker: %w", err)
	}
	return id, nil
}
