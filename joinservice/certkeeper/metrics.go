package certkeeper

import (
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/berth-k8s/berth/internal/webhook/install"
)

// Metrics of the certificate keeper:
//
//   - berth_cert_expiry_timestamp_seconds{scope,cert}: NotAfter (Unix seconds) of every certificate
//     Berth renews. scope "webhook" (cert serving, ca, bundle: the earliest of the published bundle)
//     is exported by the leader only; scope "control-plane" (cert as kubeadm names it: apiserver,
//     etcd-server, ca, ...) by every replica for its own node (expiry.go).
//   - berth_certkeeper_leader: 1 on the replica that holds the Lease.
//   - berth_certkeeper_webhook_checks_total{result}: webhook passes by result: ok, paused,
//     not-installed, config-missing, failed.
//   - berth_certkeeper_webhook_renewals_total{what}: leaf (a new serving certificate), ca (a new CA:
//     a rotation started), rotation-done, bundle-repair (a caBundle replaced that differed from the
//     Secret's).
//   - berth_certkeeper_webhook_last_success_timestamp_seconds: when the leader's last pass passed.
//   - berth_webhook_config_ok: 1 when the configuration exists and publishes the Secret's bundle,
//     0 when not (leader only).
//   - berth_certkeeper_webhook_check_seconds: how long a pass took.
//   - berth_certkeeper_csr_decisions_total{decision,reason}: kubelet serving CSRs approved or denied.
type Metrics struct {
	expiry      *prometheus.GaugeVec
	leader      prometheus.Gauge
	checks      *prometheus.CounterVec
	renewals    *prometheus.CounterVec
	lastSuccess prometheus.Gauge
	configOK    *prometheus.GaugeVec
	duration    prometheus.Histogram
	csr         *prometheus.CounterVec
}

// Scopes of berth_cert_expiry_timestamp_seconds.
const (
	ScopeWebhook      = "webhook"
	ScopeControlPlane = "control-plane"
)

// ExpiryMetric is the name of the expiry gauge.
const ExpiryMetric = "berth_cert_expiry_timestamp_seconds"

// NewMetrics registers the keeper's metrics with reg; cp, when set, reports this node's
// control-plane certificates at every scrape.
func NewMetrics(reg prometheus.Registerer, cp *ControlPlaneCerts) *Metrics {
	m := &Metrics{
		expiry: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: ExpiryMetric, Help: "NotAfter (Unix seconds) of the certificates Berth renews, by scope and certificate.",
		}, []string{"scope", "cert"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "berth_certkeeper_leader", Help: "1 on the joinservice replica that holds the certificate keeper's Lease.",
		}),
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "berth_certkeeper_webhook_checks_total", Help: "Passes over the webhook's trust chain by result (ok, paused, not-installed, config-missing, failed).",
		}, []string{"result"}),
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "berth_certkeeper_webhook_renewals_total", Help: "Changes to the webhook's trust chain: leaf, ca, rotation-done, bundle-repair.",
		}, []string{"what"}),
		lastSuccess: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "berth_certkeeper_webhook_last_success_timestamp_seconds", Help: "When the last pass over the webhook's trust chain passed (Unix seconds).",
		}),
		configOK: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "berth_webhook_config_ok", Help: "1 when the webhook configuration exists and publishes the TLS Secret's CA bundle, else 0 (leader only).",
		}, nil),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "berth_certkeeper_webhook_check_seconds", Help: "Duration of a pass over the webhook's trust chain.",
			Buckets: []float64{.1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300},
		}),
		csr: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "berth_certkeeper_csr_decisions_total", Help: "Kubelet serving certificate requests approved or denied, by reason.",
		}, []string{"decision", "reason"}),
	}
	reg.MustRegister(m.expiry, m.leader, m.checks, m.renewals, m.lastSuccess, m.configOK, m.duration, m.csr)
	if cp != nil {
		reg.MustRegister(cp)
	}
	return m
}

// Leading records whether this replica holds the Lease; a term's end drops what only the leader
// reports.
func (m *Metrics) Leading(on bool) {
	if on {
		m.leader.Set(1)
		return
	}
	m.leader.Set(0)
	// What only the leader knows goes with the term: a stale value would hide the new leader's.
	m.configOK.Reset()
	m.expiry.DeletePartialMatch(prometheus.Labels{"scope": ScopeWebhook})
}

// Pass records one webhook pass.
func (m *Metrics) Pass(rep install.KeepReport, err error, took time.Duration) {
	m.duration.Observe(took.Seconds())
	result := "ok"
	switch {
	case errors.Is(err, install.ErrNotInstalled):
		result = "not-installed"
	case errors.Is(err, install.ErrConfigMissing):
		result = "config-missing"
	case err != nil:
		result = "failed"
	case rep.Paused:
		result = "paused"
	}
	m.checks.WithLabelValues(result).Inc()
	for what, happened := range map[string]bool{"leaf": rep.LeafRenewed, "ca": rep.CARenewed, "rotation-done": rep.RotationDone, "bundle-repair": rep.BundleRepaired} {
		if happened {
			m.renewals.WithLabelValues(what).Inc()
		}
	}
	switch {
	case errors.Is(err, install.ErrNotInstalled):
		m.configOK.Reset()
	case rep.ConfigOK || rep.Paused:
		m.configOK.WithLabelValues().Set(1)
	default:
		m.configOK.WithLabelValues().Set(0)
	}
	if err == nil {
		m.lastSuccess.SetToCurrentTime()
	}
	for cert, t := range map[string]time.Time{"serving": rep.Expiry.Leaf, "ca": rep.Expiry.CA, "bundle": rep.Expiry.Bundle} {
		if !t.IsZero() {
			m.expiry.WithLabelValues(ScopeWebhook, cert).Set(float64(t.Unix()))
		}
	}
}

// CSRDecision counts a decision on a kubelet serving CSR.
func (m *Metrics) CSRDecision(decision, reason string) { m.csr.WithLabelValues(decision, reason).Inc() }
