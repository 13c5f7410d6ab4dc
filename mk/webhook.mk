# Image-policy webhook targets. The API-server tests run the default release's kube-apiserver and
# etcd (internal/k8sversion) as processes in a private network namespace (root); `scripts/build-k8s.sh k8s etcd` builds them.

.PHONY: test-e2e-webhook webhook-build test-webhook test-webhook-apiserver test-webhook-load test-webhook-load-nodrain bench-webhook

webhook-build: ## build bin/berth-webhook
	CGO_ENABLED=0 $(GO) build -trimpath -tags berthrelease -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/berth-webhook

test-webhook: ## webhook and installer unit tests (race detector)
	$(GO) test $(GOTEST_FLAGS) ./internal/webhook/ ./internal/webhook/install/

test-webhook-apiserver: ## installer + webhook against a real API server: fail-closed install, deny/allow/kube-system, every backend gone, a re-run is a no-op (root)
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) \
	  $(GO) test $(GOTEST_FLAGS) -v -timeout 10m ./internal/webhook/clustertest/

test-webhook-load: ## >=10 rolling restarts under >=5000 dry-run creates with 0 failures, leaf and CA rotation under load, resume after interrupted installs (root)
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) BERTH_WEBHOOK_LOAD=1 \
	  $(GO) test -count=1 -v -timeout 20m -run 'TestRollingRestartsUnderLoad|TestLeafRotationUnderLoad|TestCARotationUnderLoad|TestResumeAfterInterruption' ./internal/webhook/clustertest/

test-webhook-load-nodrain: ## negative control of test-webhook-load: backends without the drain; expected to FAIL
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) BERTH_WEBHOOK_LOAD=1 BERTH_WEBHOOK_NO_DRAIN=1 \
	  $(GO) test -count=1 -v -timeout 20m -run 'TestRollingRestartsUnderLoad|TestLeafRotationUnderLoad|TestCARotationUnderLoad' ./internal/webhook/clustertest/

# bench-webhook also draws each run (requests per second, p50 and p99 latency by second) into
# bin/bench-webhook.png (the webhook alone) and bin/bench-webhook-apiserver.png (through the API server).
bench-webhook: ## admission latency at 500 req/s: the webhook alone over TLS loopback, then through a real API server (root); charts in bin/
	@mkdir -p $(BIN)
	BERTH_BENCH_CHART=$(CURDIR)/$(BIN)/bench-webhook.png $(GO) test -count=1 -run '^$$' -bench 'Admission|Decide' -benchtime 5000x ./internal/webhook/
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) BERTH_BENCH_CHART=$(CURDIR)/$(BIN)/bench-webhook-apiserver.png \
	  $(GO) test -count=1 -run '^$$' -bench AdmissionViaAPIServer -benchtime 5000x -timeout 20m ./internal/webhook/clustertest/

test-e2e-webhook: build mini-build ## only TestMiniWebhook (also part of make test): rollout restarts under load, every backend gone, enforcing after berth mini restart, the re-check writes nothing (root)
	$(GO) test -tags e2e -count=1 -v -timeout 45m -run 'TestMiniWebhook' ./e2e/...
