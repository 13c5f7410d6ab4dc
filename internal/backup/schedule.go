package backup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/leaderterm"
)

// Defaults of the schedule: a snapshot every 6 hours, the newest 5 kept in every store.
const (
	DefaultInterval = 6 * time.Hour
	DefaultKeep     = 5
	// DefaultPoll is how often the leader looks for a `berth backup now` request.
	DefaultPoll = 5 * time.Second
	// retryAfter is the pause after a failed snapshot before the next attempt (at most Interval).
	retryAfter = 5 * time.Minute
	// snapshotTimeout bounds one snapshot: etcd's stream, sealing and every upload.
	snapshotTimeout = 15 * time.Minute
)

// Leader election timing (client-go's defaults for controllers).
const (
	leaseDuration = 15 * time.Second
	renewDeadline = 10 * time.Second
	retryPeriod   = 2 * time.Second
)

// EtcdFunc connects to etcd for one snapshot; the caller closes what it returns.
type EtcdFunc func(ctx context.Context) (Snapshotter, io.Closer, error)

// KMSFunc returns the KMS key generations at this moment and the active one.
type KMSFunc func(ctx context.Context) (generations []uint32, active uint32, err error)

// Schedule takes a snapshot every Interval on the replica that holds the Lease berth-backup.
type Schedule struct {
	Log *zap.Logger
	// Client reaches the API server (the Lease, the ConfigMap berth-backup).
	Client    kubernetes.Interface
	Namespace string
	// Identity names this replica in the Lease and the status.
	Identity string
	Etcd     EtcdFunc
	Keys     *clusterkeys.Keys
	KMS      KMSFunc
	// Stores receive every snapshot; the first one's list goes into the status.
	Stores []Store
	// Staging is a directory for the sealed file while it is written to the stores.
	Staging string
	// Interval, Keep and Poll; zero means the defaults.
	Interval time.Duration
	Keep     int
	Poll     time.Duration
	Metrics  *Metrics
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

func (s *Schedule) defaults() error {
	if s.Interval == 0 {
		s.Interval = DefaultInterval
	}
	if s.Keep == 0 {
		s.Keep = DefaultKeep
	}
	if s.Poll == 0 {
		s.Poll = DefaultPoll
	}
	if s.Now == nil {
		s.Now = time.Now
	}
	switch {
	case s.Interval < 0 || s.Interval > DefaultInterval:
		return fmt.Errorf("backup interval %v: want at most %v", s.Interval, DefaultInterval)
	case s.Keep < DefaultKeep:
		return fmt.Errorf("backups kept %d: want at least %d", s.Keep, DefaultKeep)
	case len(s.Stores) == 0:
		return errors.New("backups: no store")
	}
	return nil
}

// Run campaigns for the Lease until ctx ends and, while this replica holds it, keeps the schedule;
// it returns nil when ctx ends, an error only for a schedule it cannot run.
func (s *Schedule) Run(ctx context.Context) error {
	if err := s.defaults(); err != nil {
		return err
	}
	return leaderterm.Run(ctx, leaderterm.Config{
		Client: s.Client, Namespace: s.Namespace, Name: joinconfig.BackupName, Identity: s.Identity,
		LeaseDuration: leaseDuration, RenewDeadline: renewDeadline, RetryPeriod: retryPeriod,
	}, s.lead)
}

// lead keeps the schedule until ctx (the term) ends.
func (s *Schedule) lead(ctx context.Context) {
	s.Log.Info("leading the backup schedule", zap.Duration("interval", s.Interval), zap.Int("keep", s.Keep))
	s.Metrics.leading(true)
	defer s.Metrics.leading(false)
	st, req, err := ReadStatus(ctx, s.Client, s.Namespace)
	if err != nil {
		s.Log.Warn("reading the backup status", zap.Error(err))
	}
	s.Metrics.success(st)
	for {
		now := s.Now()
		next := s.next(st)
		if !now.Before(next) || req.After(st.LastAttempt) {
			st = s.once(ctx, st)
			if ctx.Err() != nil {
				return
			}
			if err := WriteStatus(ctx, s.Client, s.Namespace, st); err != nil {
				s.Log.Warn("writing the backup status", zap.Error(err))
			}
			continue
		}
		wait := min(next.Sub(now), s.Poll)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		if _, r, err := ReadStatus(ctx, s.Client, s.Namespace); err == nil {
			req = r
		}
	}
}

// next is when the next scheduled snapshot is due after st.
func (s *Schedule) next(st Status) time.Time {
	var next time.Time
	if st.LastSuccess != nil {
		next = st.LastSuccess.Taken.Add(s.Interval)
	}
	if st.LastError != "" {
		if retry := st.LastAttempt.Add(min(retryAfter, s.Interval)); retry.Before(next) || next.IsZero() {
			next = retry
		}
	}
	return next
}

// once takes one snapshot, stores and prunes it, and returns the status after it.
func (s *Schedule) once(ctx context.Context, st Status) Status {
	now := s.Now()
	st.Leader, st.Interval, st.Keep, st.LastAttempt = s.Identity, s.Interval, s.Keep, now.UTC()
	st.Stores = st.Stores[:0]
	for _, store := range s.Stores {
		st.Stores = append(st.Stores, store.String())
	}
	ctx, cancel := context.WithTimeout(ctx, snapshotTimeout)
	defer cancel()
	taken, err := s.take(ctx, now)
	if err == nil {
		st.LastError = ""
		st.LastSuccess = &taken
		s.Log.Info("etcd snapshot stored", zap.String("name", taken.Name), zap.Int64("bytes", taken.Size))
	} else {
		st.LastError = err.Error()
		s.Log.Error("etcd snapshot failed", zap.Error(err))
	}
	if objs, lerr := s.Stores[0].List(ctx); lerr == nil {
		st.Snapshots = objs
	}
	s.Metrics.result(st, err)
	return st
}

// take takes the snapshot and writes it to every store; a store that fails does not keep the others
// from getting it, but the snapshot counts as failed.
func (s *Schedule) take(ctx context.Context, now time.Time) (Object, error) {
	gens, active, err := s.KMS(ctx)
	if err != nil {
		return Object{}, fmt.Errorf("reading the KMS key spec: %w", err)
	}
	etcd, closer, err := s.Etcd(ctx)
	if err != nil {
		return Object{}, fmt.Errorf("connecting to etcd: %w", err)
	}
	taken, err := Take(ctx, etcd, s.Keys, KMSKeysOf(s.Keys, gens, active), s.Staging, now)
	closer.Close()
	if err != nil {
		return Object{}, err
	}
	defer func() { _ = os.Remove(taken.Path) }()
	var errs []error
	for _, store := range s.Stores {
		if err := PutFile(ctx, store, taken); err != nil {
			errs = append(errs, err)
			continue
		}
		if gone, err := Prune(ctx, store, s.Keep); err != nil {
			errs = append(errs, fmt.Errorf("pruning %s: %w", store, err))
		} else if len(gone) > 0 {
			s.Log.Info("old etcd snapshots removed", zap.Stringer("store", store), zap.Strings("names", gone))
		}
	}
	return taken.Object, errors.Join(errs...)
}
