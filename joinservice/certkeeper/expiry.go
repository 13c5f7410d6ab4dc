package certkeeper

import (
	"os"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/berth-k8s/berth/internal/pemcerts"
)

// ControlPlaneFiles are kubeadm's certificates of a control plane, by the names kubeadm gives them,
// relative to its PKI directory. Their kubeconfigs' client certificates (admin.conf, ...) are renewed
// with them and expire with them.
var ControlPlaneFiles = map[string]string{
	"ca":                       "ca.crt",
	"apiserver":                "apiserver.crt",
	"apiserver-kubelet-client": "apiserver-kubelet-client.crt",
	"apiserver-etcd-client":    "apiserver-etcd-client.crt",
	"front-proxy-ca":           "front-proxy-ca.crt",
	"front-proxy-client":       "front-proxy-client.crt",
	"etcd-ca":                  "etcd/ca.crt",
	"etcd-server":              "etcd/server.crt",
	"etcd-peer":                "etcd/peer.crt",
	"etcd-healthcheck-client":  "etcd/healthcheck-client.crt",
}

// ControlPlaneCerts reports the expiry of this node's control-plane certificates as
// berth_cert_expiry_timestamp_seconds{scope="control-plane"}, read from the PKI directory at every
// scrape (a renewal shows at the next scrape); a certificate that is missing or does not parse is
// left out and counted in berth_certkeeper_unreadable_certs.
type ControlPlaneCerts struct {
	dir        string
	expiry     *prometheus.Desc
	unreadable *prometheus.Desc
}

// NewControlPlaneCerts reports the certificates under pkiDir.
func NewControlPlaneCerts(pkiDir string) *ControlPlaneCerts {
	return &ControlPlaneCerts{
		dir: pkiDir,
		expiry: prometheus.NewDesc(ExpiryMetric, "NotAfter (Unix seconds) of the certificates Berth renews, by scope and certificate.",
			[]string{"scope", "cert"}, nil),
		unreadable: prometheus.NewDesc("berth_certkeeper_unreadable_certs", "Control-plane certificates of this node that are missing or do not parse.", nil, nil),
	}
}

// Describe implements prometheus.Collector. It describes nothing: the expiry gauge shares its name
// with the keeper's own (scope "webhook"), so this collector is unchecked.
func (c *ControlPlaneCerts) Describe(chan<- *prometheus.Desc) {}

// Collect implements prometheus.Collector.
func (c *ControlPlaneCerts) Collect(ch chan<- prometheus.Metric) {
	bad := 0
	for name, rel := range ControlPlaneFiles {
		data, err := os.ReadFile(filepath.Join(c.dir, rel))
		if err != nil {
			bad++
			continue
		}
		certs, err := pemcerts.Parse(data)
		if err != nil || len(certs) == 0 {
			bad++
			continue
		}
		ch <- prometheus.MustNewConstMetric(c.expiry, prometheus.GaugeValue, float64(certs[0].NotAfter.Unix()), ScopeControlPlane, name)
	}
	ch <- prometheus.MustNewConstMetric(c.unreadable, prometheus.GaugeValue, float64(bad))
}
