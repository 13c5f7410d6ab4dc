package webhook

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// latencyBuckets are the upper bounds (seconds) of the decision latency histogram.
var latencyBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1}

// Metrics counts decisions and their latency and exposes gauges, in the Prometheus text format.
type Metrics struct {
	mu        sync.Mutex
	decisions map[[2]string]uint64 // {decision, rule} -> count
	buckets   []uint64
	count     uint64
	sum       float64

	ready      atomic.Bool
	certExpiry atomic.Int64 // unix seconds of the served leaf's NotAfter
}

// NewMetrics returns empty metrics.
func NewMetrics() *Metrics {
	return &Metrics{decisions: map[[2]string]uint64{}, buckets: make([]uint64, len(latencyBuckets))}
}

func (m *Metrics) observe(allowed bool, rule string, d time.Duration) {
	decision := "deny"
	if allowed {
		decision = "allow"
	}
	s := d.Seconds()
	m.mu.Lock()
	defer m.mu.Unlock()
	m.decisions[[2]string{decision, rule}]++
	m.count++
	m.sum += s
	for i, b := range latencyBuckets {
		if s <= b {
			m.buckets[i]++
		}
	}
}

// ServeHTTP writes the metrics.
func (m *Metrics) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	m.write(w)
}

// write writes the exposition to w, the scrape's response: a failed write has nobody to report to.
func (m *Metrics) write(w io.Writer) {
	m.mu.Lock()
	keys := make([][2]string, 0, len(m.decisions))
	for k := range m.decisions {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b [2]string) int {
		if a[0] != b[0] {
			return strings.Compare(a[0], b[0])
		}
		return strings.Compare(a[1], b[1])
	})
	_, _ = fmt.Fprintln(w, "# HELP berth_webhook_decisions_total Admission decisions by decision and rule.")
	_, _ = fmt.Fprintln(w, "# TYPE berth_webhook_decisions_total counter")
	for _, k := range keys {
		_, _ = fmt.Fprintf(w, "berth_webhook_decisions_total{decision=%q,rule=%q} %d\n", k[0], k[1], m.decisions[k])
	}
	_, _ = fmt.Fprintln(w, "# HELP berth_webhook_decision_seconds Time from request to written response.")
	_, _ = fmt.Fprintln(w, "# TYPE berth_webhook_decision_seconds histogram")
	for i, b := range latencyBuckets {
		_, _ = fmt.Fprintf(w, "berth_webhook_decision_seconds_bucket{le=\"%g\"} %d\n", b, m.buckets[i])
	}
	_, _ = fmt.Fprintf(w, "berth_webhook_decision_seconds_bucket{le=\"+Inf\"} %d\n", m.count)
	_, _ = fmt.Fprintf(w, "berth_webhook_decision_seconds_sum %g\nberth_webhook_decision_seconds_count %d\n", m.sum, m.count)
	m.mu.Unlock()
	ready := 0
	if m.ready.Load() {
		ready = 1
	}
	_, _ = fmt.Fprintln(w, "# HELP berth_webhook_ready Whether the last readiness check passed.")
	_, _ = fmt.Fprintln(w, "# TYPE berth_webhook_ready gauge")
	_, _ = fmt.Fprintf(w, "berth_webhook_ready %d\n", ready)
	_, _ = fmt.Fprintln(w, "# HELP berth_webhook_cert_expiry_timestamp_seconds NotAfter of the served certificate.")
	_, _ = fmt.Fprintln(w, "# TYPE berth_webhook_cert_expiry_timestamp_seconds gauge")
	_, _ = fmt.Fprintf(w, "berth_webhook_cert_expiry_timestamp_seconds %d\n", m.certExpiry.Load())
}
