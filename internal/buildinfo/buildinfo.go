// Package buildinfo exports berth_build_info{version,commit,go_version} = 1, the gauge every Berth
// binary that serves Prometheus metrics registers (joinservice, berth-webhook), so that a
// dashboard can tell which build each target runs.
package buildinfo

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/berth-k8s/berth/internal/version"
)

// Name is the metric's name.
const Name = "berth_build_info"

// Collector returns the gauge, labelled from internal/version and the Go runtime.
func Collector() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: Name,
		Help: "Always 1; the labels say which build of Berth this is.",
		ConstLabels: prometheus.Labels{
			"version":    version.Version,
			"commit":     version.Commit(),
			"go_version": runtime.Version(),
		},
	}, func() float64 { return 1 })
}

// Register registers the gauge with reg.
func Register(reg prometheus.Registerer) error { return reg.Register(Collector()) }
