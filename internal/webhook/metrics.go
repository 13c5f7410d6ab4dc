package webhook

import (
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/berth-k8s/berth/internal/buildinfo"
)

// latencyBuckets are the upper bounds (seconds) of the decision latency histogram.
var latencyBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1}

// Metrics holds the webhook's Prometheus metrics in their own registry and serves them
// (http.Handler):
//   - berth_webhook_decisions_total{decision,rule}: admission decisions (allow, deny) by the rule
//     that made them (a policy rule's name, or one of the Rule* names);
//   - berth_webhook_decision_seconds: histogram of the time from request to written response;
//   - berth_webhook_ready: 1 when the last readiness check passed;
//   - berth_webhook_cert_expiry_timestamp_seconds: NotAfter of the serving certificate in use;
//   - berth_build_info, and the Go runtime and process collectors.
type Metrics struct {
	reg        *prometheus.Registry
	handler    http.Handler
	decisions  *prometheus.CounterVec
	latency    prometheus.Histogram
	ready      prometheus.Gauge
	certExpiry prometheus.Gauge
}

// NewMetrics returns the metrics in a fresh registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "berth_webhook_decisions_total", Help: "Admission decisions by decision and rule.",
		}, []string{"decision", "rule"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "berth_webhook_decision_seconds", Help: "Time from request to written response.", Buckets: latencyBuckets,
		}),
		ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "berth_webhook_ready", Help: "Whether the last readiness check passed.",
		}),
		certExpiry: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "berth_webhook_cert_expiry_timestamp_seconds", Help: "NotAfter of the served certificate (Unix seconds).",
		}),
	}
	m.reg.MustRegister(m.decisions, m.latency, m.ready, m.certExpiry, buildinfo.Collector(),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.handler = promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
	return m
}

// Registry is the registry the metrics are in.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

func (m *Metrics) observe(allowed bool, rule string, d time.Duration) {
	decision := "deny"
	if allowed {
		decision = "allow"
	}
	m.decisions.WithLabelValues(decision, rule).Inc()
	m.latency.Observe(d.Seconds())
}

func (m *Metrics) setReady(ready bool) {
	v := 0.0
	if ready {
		v = 1
	}
	m.ready.Set(v)
}

func (m *Metrics) setCertExpiry(notAfter time.Time) { m.certExpiry.Set(float64(notAfter.Unix())) }

// ServeHTTP writes the metrics in the Prometheus exposition format.
func (m *Metrics) ServeHTTP(w http.ResponseWriter, r *http.Request) { m.handler.ServeHTTP(w, r) }
