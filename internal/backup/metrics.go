package backup

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics of the backup schedule:
//
//   - berth_backup_last_success_timestamp_seconds: when the last snapshot written to every store
//     was taken (Unix seconds); 0 before the first. Exported by the replica that schedules.
//   - berth_backup_last_size_bytes: the sealed size of that snapshot.
//   - berth_backup_snapshots_total{result}: snapshots attempted, by result (ok, failed).
//   - berth_backup_leader: 1 on the replica that holds the Lease berth-backup.
type Metrics struct {
	lastSuccess prometheus.Gauge
	lastSize    prometheus.Gauge
	snapshots   *prometheus.CounterVec
	leader      prometheus.Gauge
}

// LastSuccessMetric is the name of the gauge the alert BerthBackupStale watches.
const LastSuccessMetric = "berth_backup_last_success_timestamp_seconds"

// NewMetrics registers the schedule's metrics with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: LastSuccessMetric, Help: "When the last etcd snapshot written to every store was taken (Unix seconds); 0 before the first.",
		}),
		lastSize: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "berth_backup_last_size_bytes", Help: "Sealed size of the last etcd snapshot written to every store.",
		}),
		snapshots: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "berth_backup_snapshots_total", Help: "etcd snapshots attempted by the backup schedule, by result (ok, failed).",
		}, []string{"result"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "berth_backup_leader", Help: "1 on the joinservice replica that holds the backup schedule's Lease.",
		}),
	}
	m.snapshots.WithLabelValues("ok")
	m.snapshots.WithLabelValues("failed")
	reg.MustRegister(m.lastSuccess, m.lastSize, m.snapshots, m.leader)
	return m
}

func (m *Metrics) result(st Status, err error) {
	if m == nil {
		return
	}
	if err != nil {
		m.snapshots.WithLabelValues("failed").Inc()
	} else {
		m.snapshots.WithLabelValues("ok").Inc()
	}
	m.success(st)
}

func (m *Metrics) success(st Status) {
	if m == nil || st.LastSuccess == nil {
		return
	}
	m.lastSuccess.Set(float64(st.LastSuccess.Taken.UnixMilli()) / 1000)
	m.lastSize.Set(float64(st.LastSuccess.Size))
}

func (m *Metrics) leading(on bool) {
	if m == nil {
		return
	}
	if on {
		m.leader.Set(1)
	} else {
		m.leader.Set(0)
	}
}

// Snapshots returns the counter of snapshots with result (ok, failed), for tests.
func (m *Metrics) Snapshots(result string) prometheus.Counter {
	return m.snapshots.WithLabelValues(result)
}
