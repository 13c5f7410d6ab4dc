# Monitoring: the Grafana dashboard and the Prometheus alert rules in deploy/monitoring.
# promtool comes with the Debian package prometheus (scripts/install-deps.sh).

.PHONY: check-monitoring

check-monitoring: ## dashboard and alert expressions name only metrics Berth exports (Go test); promtool check rules and the alert unit tests (alerts_test.yaml)
	$(GO) test -count=1 ./deploy/monitoring/
	@command -v promtool >/dev/null || { echo "check-monitoring: promtool not found: install the Debian package prometheus (scripts/install-deps.sh)" >&2; exit 1; }
	promtool check rules deploy/monitoring/alerts.yaml
	promtool test rules deploy/monitoring/alerts_test.yaml
