package backup

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// Snapshotter is the part of an etcd client a snapshot needs (clientv3.Maintenance).
type Snapshotter interface {
	SnapshotWithVersion(ctx context.Context) (*clientv3.SnapshotResponse, error)
}

// Taken is a sealed snapshot in a local file, ready to be stored.
type Taken struct {
	Object
	// Path is the sealed file; the caller removes it.
	Path string
	// EtcdSize is the size of etcd's snapshot before sealing.
	EtcdSize int64
}

// Take streams etcd's snapshot, sealed with keys and carrying kms, into a new file in dir. The file
// is removed again when anything fails.
func Take(ctx context.Context, etcd Snapshotter, keys *clusterkeys.Keys, kms KMSKeys, dir string, now time.Time) (Taken, error) {
	resp, err := etcd.SnapshotWithVersion(ctx)
	if err != nil {
		return Taken{}, fmt.Errorf("asking etcd for a snapshot: %w", err)
	}
	defer resp.Snapshot.Close()
	m := Manifest{ClusterID: hex.EncodeToString(keys.ClusterID()), Taken: now.UTC(), KMS: kms}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Taken{}, fmt.Errorf("creating %s: %w", dir, err)
	}
	f, err := os.CreateTemp(dir, ".taking-*")
	if err != nil {
		return Taken{}, fmt.Errorf("creating the snapshot's file: %w", err)
	}
	fail := func(err error) (Taken, error) {
		f.Close()
		_ = os.Remove(f.Name())
		return Taken{}, err
	}
	n, err := Seal(f, keys, m, resp.Snapshot)
	if err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("writing the snapshot's file: %w", err))
	}
	size, err := f.Seek(0, io.SeekCurrent)
	if err != nil {
		return fail(fmt.Errorf("writing the snapshot's file: %w", err))
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(f.Name())
		return Taken{}, fmt.Errorf("writing the snapshot's file: %w", err)
	}
	return Taken{Object: Object{Name: Name(now), Taken: now.UTC().Truncate(time.Millisecond), Size: size}, Path: f.Name(), EtcdSize: n}, nil
}

// PutFile stores the sealed file t in s.
func PutFile(ctx context.Context, s Store, t Taken) error {
	f, err := os.Open(t.Path)
	if err != nil {
		return fmt.Errorf("reading the snapshot's file: %w", err)
	}
	defer f.Close()
	return s.Put(ctx, t.Name, f, t.Size)
}
