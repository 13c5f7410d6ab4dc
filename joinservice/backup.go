package joinservice

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"time"

	"go.uber.org/zap"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/berth-k8s/berth/internal/backup"
	"github.com/berth-k8s/berth/internal/clusterkeys"
	"github.com/berth-k8s/berth/internal/joinconfig"
	"github.com/berth-k8s/berth/internal/kmsstate"
	"github.com/berth-k8s/berth/joinservice/membership"
	"github.com/berth-k8s/berth/joinservice/metrics"
)

// BackupConfig is the backup schedule's part of the joinservice's settings (its flags; the cluster
// configuration file will carry Interval and Keep once it exists).
type BackupConfig struct {
	// Dir is the local directory of the snapshots (the state disk); empty turns the schedule off.
	Dir string
	// Interval and Keep; zero means backup.DefaultInterval and backup.DefaultKeep.
	Interval time.Duration
	Keep     int
}

// backupSchedule builds the schedule of d: the local directory, and the object store of Secret
// berth-backup-store when the operator created it (read once, at start). A Secret that cannot be
// read or used leaves the object store out: joins matter more than backups, and the schedule's
// status names the stores it writes to.
func backupSchedule(ctx context.Context, d Deps, keys *clusterkeys.Keys, m *metrics.Metrics) *backup.Schedule {
	stores := []backup.Store{backup.NewDir(d.Backup.Dir)}
	if s3, err := objectStore(ctx, d); err != nil {
		d.Log.Error("backup object store not used", zap.Error(err))
	} else if s3 != nil {
		stores = append(stores, s3)
	}
	etcd := membership.New(d.PKIDir, d.Log.Named("backup-etcd"))
	return &backup.Schedule{
		Log: d.Log.Named("backup"), Client: d.Client, Namespace: d.Namespace, Identity: d.Replica,
		Etcd: func(context.Context) (backup.Snapshotter, io.Closer, error) {
			c, err := etcd.Client()
			if err != nil {
				return nil, nil, err
			}
			return c, c, nil
		},
		Keys: keys,
		KMS: func(ctx context.Context) ([]uint32, uint32, error) {
			st, err := kmsstate.Read(ctx, d.Client)
			return st.Spec.Generations, st.Spec.Active, err
		},
		Stores: stores, Staging: filepath.Join(d.Backup.Dir, ".staging"),
		Interval: d.Backup.Interval, Keep: d.Backup.Keep, Metrics: backup.NewMetrics(m.Registry()),
	}
}

// objectStore is the store Secret berth-backup-store names, or nil without the Secret.
func objectStore(ctx context.Context, d Deps) (*backup.S3, error) {
	sec, err := d.Client.CoreV1().Secrets(d.Namespace).Get(ctx, joinconfig.BackupStoreSecretName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the backup store's Secret: %w", err)
	}
	v := func(k string) string { return string(sec.Data[k]) }
	s3, err := backup.NewS3(backup.S3Config{
		Endpoint: v(joinconfig.BackupStoreEndpoint), Region: v(joinconfig.BackupStoreRegion),
		Bucket: v(joinconfig.BackupStoreBucket), Prefix: v(joinconfig.BackupStorePrefix),
		AccessKey: v(joinconfig.BackupStoreAccessKey), SecretKey: v(joinconfig.BackupStoreSecretKey),
		PathStyle: v(joinconfig.BackupStorePathStyle) == "true",
	})
	if err != nil {
		return nil, fmt.Errorf("the backup store's Secret: %w", err)
	}
	return s3, nil
}
