// Package metrics exports the joinservice's Prometheus metrics and serves them on their own port.
//
// Metrics (namespace berth_joinservice):
//   - attempts_total{rpc,outcome,reason}: finished IssueJoinTicket ("join"), IssueRejoinTicket
//     ("rejoin"), CheckIn ("checkin") and IssueAdminCredential ("admin-credential") calls, and
//     attested TLS handshakes refused before any call ("handshake"); reason is the rejection's reason code, "" when accepted.
//   - duration_seconds{rpc,stage}: latency histogram; stage "validate" is the attestation check, the
//     metadata lookup and the role check, "issue" the CSR signature, the control-plane lock and the
//     bootstrap token, "total" the whole call from after the rate limit to the answer.
//   - in_flight: calls being handled.
//   - ledger_dropped_total: join-ledger entries lost because its queue was full.
//   - ledger_superseded_total: join-ledger entries not written because more than the ledger's
//     capacity of newer ones came within one write interval (floods).
//   - policy_reloads_total{result}: attestation policy updates applied ("applied") or refused
//     ("rejected").
//   - attestation_operations_total{purpose,operation}: the attestation work of this replica's TPM
//     (or TDX module): operation "quote" (a document) or "activation" (a TPM2_ActivateCredential),
//     for purpose "connection" (one handshake: a node that cannot take the session proof),
//     "session" (the session proof, renewed every 10 s for every node) or "self_check" (readiness).
//     A join that took the session proof adds nothing to purpose "connection".
//
// The registry also holds berth_build_info (internal/buildinfo) and the Go runtime and process
// collectors.
package metrics

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"

	"github.com/berth-k8s/berth/internal/buildinfo"
	"github.com/berth-k8s/berth/internal/serve"
)

const namespace = "berth_joinservice"

// Metrics implements server.Observer.
type Metrics struct {
	reg      *prometheus.Registry
	attempts *prometheus.CounterVec
	duration *prometheus.HistogramVec
	inFlight prometheus.Gauge
	reloads  *prometheus.CounterVec
	attestOp *prometheus.CounterVec
}

// Purposes and operations of AttestationOperation.
const (
	PurposeConnection = "connection"
	PurposeSession    = "session"
	PurposeSelfCheck  = "self_check"
	OperationQuote    = "quote"
	OperationActivate = "activation"
)

// Ledger is the join ledger's counters (ledger.Writer).
type Ledger interface {
	Dropped() uint64
	Superseded() uint64
}

// New returns Metrics in a fresh registry, reporting l's counters unless l is nil.
func New(l Ledger) *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "attempts_total", Help: "Finished join attempts by RPC, outcome and reason code.",
		}, []string{"rpc", "outcome", "reason"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "duration_seconds", Help: "Latency of join attempts by RPC and stage (validate, issue, total).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"rpc", "stage"}),
		inFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "in_flight", Help: "Join attempts being handled.",
		}),
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "policy_reloads_total", Help: "Attestation policy updates by result (applied, rejected).",
		}, []string{"result"}),
		attestOp: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "attestation_operations_total",
			Help: "Attestation operations of this replica's TPM or TDX module by purpose (connection, session, self_check) and operation (quote, activation).",
		}, []string{"purpose", "operation"}),
	}
	for _, p := range []string{PurposeConnection, PurposeSession, PurposeSelfCheck} {
		m.attestOp.WithLabelValues(p, OperationQuote)
	}
	m.attestOp.WithLabelValues(PurposeConnection, OperationActivate)
	m.reg.MustRegister(m.attempts, m.duration, m.inFlight, m.reloads, m.attestOp, buildinfo.Collector(),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if l != nil {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: namespace, Name: "ledger_dropped_total", Help: "Join-ledger entries lost because the ledger queue was full.",
		}, func() float64 { return float64(l.Dropped()) }), prometheus.NewCounterFunc(prometheus.CounterOpts{
			Namespace: namespace, Name: "ledger_superseded_total", Help: "Join-ledger entries not written because more newer ones than the ledger keeps came within one write interval.",
		}, func() float64 { return float64(l.Superseded()) }))
	}
	return m
}

// Attempt counts a finished attempt.
func (m *Metrics) Attempt(rpc, outcome, reason string) {
	m.attempts.WithLabelValues(rpc, outcome, reason).Inc()
}

// Latency observes the duration of a stage.
func (m *Metrics) Latency(rpc, stage string, d time.Duration) {
	m.duration.WithLabelValues(rpc, stage).Observe(d.Seconds())
}

// InFlight adds delta to the in-flight gauge.
func (m *Metrics) InFlight(delta int) { m.inFlight.Add(float64(delta)) }

// PolicyReload counts a policy update; applied says whether it took effect.
func (m *Metrics) PolicyReload(applied bool) {
	result := "rejected"
	if applied {
		result = "applied"
	}
	m.reloads.WithLabelValues(result).Inc()
}

// AttestationOperation counts one attestation operation of this replica's TPM or TDX module.
func (m *Metrics) AttestationOperation(purpose, operation string) {
	m.attestOp.WithLabelValues(purpose, operation).Inc()
}

// Registry is the registry the metrics are in.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in the Prometheus exposition format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// Serve serves /metrics on lis until ctx ends, and /livez and /readyz from probes unless it is nil.
func (m *Metrics) Serve(ctx context.Context, lis net.Listener, probes http.Handler, log *zap.Logger) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	if probes != nil {
		mux.Handle("/livez", probes)
		mux.Handle("/readyz", probes)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	log.Info("metrics serving", zap.String("address", lis.Addr().String()))
	if err := serve.HTTP(ctx, srv, lis, 5*time.Second); err != nil {
		return fmt.Errorf("serving metrics: %w", err)
	}
	return nil
}
