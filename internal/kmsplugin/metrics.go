package kmsplugin

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/berth-k8s/berth/internal/buildinfo"
	"github.com/berth-k8s/berth/internal/serve"
)

// MetricsPort is the plugin's default metrics port: Berth's host ports are the block 9000-9004
// (internal/joinconfig explains the choice; 9004 is this one). The bootstrapper binds it on every address
// of the control plane unless told otherwise (--kms-metrics-listen), so that Prometheus in the
// cluster reaches it.
const MetricsPort = 9004

const metricsNamespace = "berth_kms"

// Metrics exports the plugin's Prometheus metrics (namespace berth_kms):
//   - healthy: 1 when the last Status call's self-test (encrypt and decrypt under the active key)
//     passed, 0 when it failed or the plugin holds no key yet. The API server calls Status at least
//     once a minute, and for every kms-providers health check older than 20 s.
//   - active_generation: the generation of the key Encrypt uses (0 without keys).
//   - generations: how many generations the plugin can decrypt with (more than one during a rotation).
//   - key_info{key_id,generation,active}: 1 for every key the plugin holds.
//   - requests_total{method,result}: Encrypt, Decrypt and Status calls by result ("ok", "error").
//   - request_duration_seconds{method}: their latency.
//
// The registry also holds berth_build_info and the Go runtime and process collectors.
type Metrics struct {
	reg      *prometheus.Registry
	healthy  prometheus.Gauge
	active   prometheus.Gauge
	gens     prometheus.Gauge
	keyInfo  *prometheus.GaugeVec
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec

	mu sync.Mutex
}

// NewMetrics returns Metrics in a fresh registry.
func NewMetrics() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		healthy: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "healthy",
			Help: "1 when the plugin's last status self-test (encrypt and decrypt under the active key) passed, else 0.",
		}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "active_generation", Help: "Generation of the key-encryption key Encrypt uses (0: no key).",
		}),
		gens: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "generations", Help: "Generations of the key-encryption key the plugin can decrypt with.",
		}),
		keyInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metricsNamespace, Name: "key_info", Help: "1 for every key the plugin holds, by key ID, generation and whether it is the active one.",
		}, []string{"key_id", "generation", "active"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricsNamespace, Name: "requests_total", Help: "KMS API calls by method (encrypt, decrypt, status) and result (ok, error).",
		}, []string{"method", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metricsNamespace, Name: "request_duration_seconds", Help: "Latency of KMS API calls by method.",
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1},
		}, []string{"method"}),
	}
	m.reg.MustRegister(m.healthy, m.active, m.gens, m.keyInfo, m.requests, m.duration,
		buildinfo.Collector(), collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Request implements Observer.
func (m *Metrics) Request(method, _ string, err error, took time.Duration) {
	result := "ok"
	if err != nil {
		result = "error"
	}
	m.requests.WithLabelValues(method, result).Inc()
	m.duration.WithLabelValues(method).Observe(took.Seconds())
}

// Health implements Observer.
func (m *Metrics) Health(healthy bool, _ string) {
	v := 0.0
	if healthy {
		v = 1
	}
	m.healthy.Set(v)
}

// Keys records the key set the plugin holds now.
func (m *Metrics) Keys(s KeySet) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.keyInfo.Reset()
	for _, k := range s.Keys {
		m.keyInfo.WithLabelValues(KeyID(k.Generation, k.KEK), strconv.FormatUint(uint64(k.Generation), 10),
			strconv.FormatBool(k.Generation == s.Active)).Set(1)
	}
	m.active.Set(float64(s.Active))
	m.gens.Set(float64(len(s.Keys)))
}

// Registry is the registry the metrics are in.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Serve serves /metrics on lis until ctx ends.
func (m *Metrics) Serve(ctx context.Context, lis net.Listener) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	if err := serve.HTTP(ctx, srv, lis, 5*time.Second); err != nil {
		return fmt.Errorf("serving metrics: %w", err)
	}
	return nil
}
