// Package monitoring holds Berth's Grafana dashboard (grafana-dashboard.json) and Prometheus alert
// rules (alerts.yaml, with promtool unit tests in alerts_test.yaml). It has no code: its test checks
// that every PromQL expression in both names only metrics the Berth binaries export, gathered from
// the binaries' own registries. `make check-monitoring` runs that test and promtool.
package monitoring
