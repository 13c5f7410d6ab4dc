// Package monitoring holds Berth's Grafana dashboard (grafana-dashboard.json), Prometheus alert
// rules (alerts.yaml, with promtool unit tests in alerts_test.yaml) and scrape configuration
// (prometheus.yml, and podmonitors.yaml for the Prometheus Operator). It has no code: its tests
// check that every PromQL expression names only metrics the Berth binaries export, gathered from
// the binaries' own registries, and that each scrape job finds its component among the pods Berth
// deploys. `make check-monitoring` runs them and promtool.
package monitoring
