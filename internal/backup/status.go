package backup

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1ac "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/berth-k8s/berth/internal/joinconfig"
)

// Keys of the ConfigMap berth-backup (joinconfig.BackupName).
const (
	// KeyStatus holds Status as JSON; the scheduling replica writes it.
	KeyStatus = "status"
	// KeyRequest holds the time (RFC 3339) of the last `berth backup now`: the scheduler takes a
	// snapshot when it is later than its last attempt.
	KeyRequest = "request"
)

// Field managers of the ConfigMap's keys.
const (
	statusManager  = "berth-backup-schedule"
	requestManager = "berth-backup-now"
)

// Status is the backup schedule's report.
type Status struct {
	// Leader is the replica that wrote it.
	Leader string `json:"leader"`
	// Interval and Keep are the schedule it runs.
	Interval time.Duration `json:"interval"`
	Keep     int           `json:"keep"`
	// Stores names the stores it writes to.
	Stores []string `json:"stores"`
	// LastAttempt is when the last snapshot was started; LastError why it failed ("" when it did not).
	LastAttempt time.Time `json:"lastAttempt,omitzero"`
	LastError   string    `json:"lastError,omitempty"`
	// LastSuccess is the last snapshot written to every store.
	LastSuccess *Object `json:"lastSuccess,omitempty"`
	// Snapshots are those the first store holds, oldest first.
	Snapshots []Object `json:"snapshots,omitempty"`
}

// Age is how old the last successful snapshot is at now; false without one.
func (s Status) Age(now time.Time) (time.Duration, bool) {
	if s.LastSuccess == nil {
		return 0, false
	}
	return now.Sub(s.LastSuccess.Taken), true
}

// ReadStatus reads the schedule's status and the last request; a cluster without the ConfigMap has
// the zero ones.
func ReadStatus(ctx context.Context, client kubernetes.Interface, ns string) (Status, time.Time, error) {
	cm, err := client.CoreV1().ConfigMaps(ns).Get(ctx, joinconfig.BackupName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return Status{}, time.Time{}, nil
	}
	if err != nil {
		return Status{}, time.Time{}, fmt.Errorf("reading %s/%s: %w", ns, joinconfig.BackupName, err)
	}
	var st Status
	if b := cm.Data[KeyStatus]; b != "" {
		if err := json.Unmarshal([]byte(b), &st); err != nil {
			return Status{}, time.Time{}, fmt.Errorf("decoding %s of %s/%s: %w", KeyStatus, ns, joinconfig.BackupName, err)
		}
	}
	var req time.Time
	if r := cm.Data[KeyRequest]; r != "" {
		if req, err = time.Parse(time.RFC3339Nano, r); err != nil {
			return Status{}, time.Time{}, fmt.Errorf("decoding %s of %s/%s: %w", KeyRequest, ns, joinconfig.BackupName, err)
		}
	}
	return st, req, nil
}

// WriteStatus writes st as the scheduler's.
func WriteStatus(ctx context.Context, client kubernetes.Interface, ns string, st Status) error {
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("encoding the backup status: %w", err)
	}
	return applyKey(ctx, client, ns, statusManager, KeyStatus, string(b))
}

// Request asks the scheduler for a snapshot now (`berth backup now`); it returns the request's time.
func Request(ctx context.Context, client kubernetes.Interface, ns string, now time.Time) (time.Time, error) {
	now = now.UTC()
	return now, applyKey(ctx, client, ns, requestManager, KeyRequest, now.Format(time.RFC3339Nano))
}

func applyKey(ctx context.Context, client kubernetes.Interface, ns, manager, key, value string) error {
	cm := corev1ac.ConfigMap(joinconfig.BackupName, ns).
		WithLabels(map[string]string{joinconfig.PartOfLabel: joinconfig.PartOf}).
		WithData(map[string]string{key: value})
	if _, err := client.CoreV1().ConfigMaps(ns).Apply(ctx, cm, metav1.ApplyOptions{FieldManager: manager, Force: true}); err != nil {
		return fmt.Errorf("writing %s of %s/%s: %w", key, ns, joinconfig.BackupName, err)
	}
	return nil
}
