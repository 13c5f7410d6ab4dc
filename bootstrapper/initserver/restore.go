package initserver

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"

	"go.uber.org/zap"

	"github.com/berth-k8s/berth/bootstrapper/initcluster"
	"github.com/berth-k8s/berth/initproto"
	"github.com/berth-k8s/berth/internal/atls"
	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
)

// MaxSnapshot bounds the sealed snapshot a Restore accepts: etcd's largest backend quota (8 GiB)
// with room for the seal.
const MaxSnapshot int64 = 9 << 30

// MaxSnapshotChunk bounds one snapshot message, well under gRPC's default receive limit of 4 MiB.
const MaxSnapshotChunk = 1 << 20

// Named refusals of a Restore's snapshot; the node stays fresh after each.
var (
	// ErrSnapshotTooLarge: the snapshot exceeds MaxSnapshot.
	ErrSnapshotTooLarge = fmt.Errorf("the snapshot exceeds %d bytes", MaxSnapshot)
	// ErrSnapshotStream: a message after the first was not a snapshot chunk, or a chunk exceeds
	// MaxSnapshotChunk, or no snapshot byte came.
	ErrSnapshotStream = errors.New("the restore stream must carry the init request, then only snapshot chunks of at most 1 MiB")
	// ErrSnapshotCluster: the snapshot's manifest names another cluster than the request's secrets.
	ErrSnapshotCluster = errors.New("the snapshot's manifest names another cluster than the master secret's")
)

// WithSnapshotDir sets the directory a Restore's sealed snapshot is received into (default: the
// system's temporary directory). The file is sealed: it needs no protection beyond its mode, only
// room.
func WithSnapshotDir(dir string) Option { return func(s *Server) { s.snapshotDir = dir } }

// snapshotReceiver receives a Restore's snapshot and opens it with req's keys; the cleanup it
// returns removes the received file.
type snapshotReceiver func(ctx context.Context, req initcluster.Request) (*initcluster.Restore, func(), error)

// Restore implements the Restore RPC: Init's checks on the first message, then the snapshot.
func (s *Server) Restore(stream initproto.InitService_RestoreServer) error {
	ctx := stream.Context()
	if !s.allowPeer(ctx) {
		return errRateLimited
	}
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	req := first.GetInit()
	if err := s.admit(ctx, req); err != nil {
		return err
	}
	log := s.log.With(zap.String("peer", atls.PeerAddr(ctx)))
	log.Info("restore request accepted")
	return s.run(ctx, log, req, &sender{stream: stream, now: s.now}, func(_ context.Context, parsed initcluster.Request) (*initcluster.Restore, func(), error) {
		return s.receiveSnapshot(stream, parsed.Keys)
	})
}

// receiveSnapshot writes the snapshot's chunks to a file until the caller closes its side, then
// opens the whole file with keys: a snapshot of another cluster, or one cut or changed, is refused
// before the node is touched.
func (s *Server) receiveSnapshot(stream initproto.InitService_RestoreServer, keys *clusterkeys.Keys) (*initcluster.Restore, func(), error) {
	f, err := os.CreateTemp(s.snapshotDir, "berth-restore-*.berth-snapshot")
	if err != nil {
		return nil, nil, fmt.Errorf("receiving the snapshot: %w", err)
	}
	cleanup := func() { _ = os.Remove(f.Name()) }
	fail := func(err error) (*initcluster.Restore, func(), error) {
		_ = f.Close()
		cleanup()
		return nil, nil, err
	}
	var size int64
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fail(fmt.Errorf("receiving the snapshot: %w", err))
		}
		chunk, ok := msg.GetKind().(*initproto.RestoreRequest_Snapshot)
		if !ok || len(chunk.Snapshot) > MaxSnapshotChunk {
			return fail(ErrSnapshotStream)
		}
		if size += int64(len(chunk.Snapshot)); size > MaxSnapshot {
			return fail(ErrSnapshotTooLarge)
		}
		if _, err := f.Write(chunk.Snapshot); err != nil {
			return fail(fmt.Errorf("receiving the snapshot: %w", err))
		}
	}
	if size == 0 {
		return fail(ErrSnapshotStream)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fail(fmt.Errorf("receiving the snapshot: %w", err))
	}
	m, r, err := backup.Open(f, keys)
	if err != nil {
		return fail(err)
	}
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fail(err)
	}
	if m.ClusterID != hex.EncodeToString(keys.ClusterID()) {
		return fail(ErrSnapshotCluster)
	}
	if err := f.Close(); err != nil {
		return fail(fmt.Errorf("receiving the snapshot: %w", err))
	}
	return &initcluster.Restore{Snapshot: f.Name(), Manifest: m}, cleanup, nil
}

// restoreFailure ends a Restore whose snapshot was refused or could not be received.
func (s *sender) restoreFailure(log *zap.Logger, err error) error {
	for _, named := range []error{backup.ErrWrongSecret, backup.ErrCorrupt, ErrSnapshotTooLarge, ErrSnapshotStream, ErrSnapshotCluster} {
		if errors.Is(err, named) {
			log.Warn("restore refused: the snapshot", zap.Error(err))
			return s.failure(initproto.FailureCode_FAILURE_CODE_INVALID_REQUEST, "snapshot: "+named.Error()+"; nothing was changed on the node", "", false)
		}
	}
	log.Error("receiving the snapshot", zap.Error(err))
	return s.failure(initproto.FailureCode_FAILURE_CODE_PHASE_FAILED, "receiving the snapshot failed; see the node's log", "", true)
}
