package backup

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"go.etcd.io/etcd/etcdutl/v3/snapshot"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// RevisionBump is how far a restore moves etcd's revision past the snapshot's (and marks the
// snapshot's compacted): a watch cache or client that saw a later revision of the old cluster must
// not mistake older data for newer.
const RevisionBump = 1_000_000_000

// Member names the etcd member a restored data directory starts as: the one-member cluster of the
// first control plane that kubeadm init then runs etcd for.
type Member struct {
	// Name is the member's name (kubeadm's: the node name).
	Name string
	// PeerURL is its peer URL (kubeadm's: https://ADDRESS:2380).
	PeerURL string
}

// ErrDataDirExists is returned by Restore for a data directory that exists: a restore never writes
// over etcd data.
var ErrDataDirExists = errors.New("the etcd data directory exists")

// Restore opens the sealed snapshot r with keys, reads it to its end (so that a damaged or cut
// snapshot is refused before anything is written), and restores etcd's data into dataDir, which
// must not exist, as the one-member cluster m. It returns the snapshot's manifest (with the KMS
// keys the Secrets in it are encrypted under). On failure dataDir is left absent.
func Restore(r io.Reader, keys *clusterkeys.Keys, m Member, dataDir string, log *zap.Logger) (Manifest, error) {
	if m.Name == "" || m.PeerURL == "" {
		return Manifest{}, errors.New("restoring etcd: the member needs a name and a peer URL")
	}
	if _, err := os.Stat(dataDir); err == nil {
		return Manifest{}, fmt.Errorf("restoring etcd into %s: %w", dataDir, ErrDataDirExists)
	}
	man, data, err := Open(r, keys)
	if err != nil {
		return Manifest{}, err
	}
	parent := filepath.Dir(dataDir)
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return Manifest{}, fmt.Errorf("restoring etcd: %w", err)
	}
	tmp, err := os.CreateTemp(parent, ".restoring-*.db")
	if err != nil {
		return Manifest{}, fmt.Errorf("restoring etcd: %w", err)
	}
	defer func() { _ = os.Remove(tmp.Name()) }()
	if _, err := io.Copy(tmp, data); err != nil {
		tmp.Close()
		return Manifest{}, err // ErrCorrupt, named by Open's reader
	}
	if err := tmp.Close(); err != nil {
		return Manifest{}, fmt.Errorf("restoring etcd: %w", err)
	}
	if log == nil {
		log = zap.NewNop()
	}
	err = snapshot.NewV3(log).Restore(snapshot.RestoreConfig{
		SnapshotPath: tmp.Name(), Name: m.Name, OutputDataDir: dataDir,
		PeerURLs: []string{m.PeerURL}, InitialCluster: m.Name + "=" + m.PeerURL, InitialClusterToken: "berth-restore",
		RevisionBump: RevisionBump, MarkCompacted: true,
	})
	if err != nil {
		_ = os.RemoveAll(dataDir)
		return Manifest{}, fmt.Errorf("restoring etcd into %s: %w", dataDir, err)
	}
	return man, nil
}
