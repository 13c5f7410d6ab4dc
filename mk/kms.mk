# Secrets at rest: the KMS v2 plugin (internal/kmsplugin) every control plane runs, its key keeper
# (bootstrapper/kmskeeper) and `berth secrets rotate-key`.

.PHONY: test-kms bench-kms

test-kms: ## KMS plugin, keeper and rotation tests with the race detector, against a real API server and etcd where they are built
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) \
	  $(GO) test $(GOTEST_FLAGS) ./internal/kmsplugin/ ./internal/etcdscan/ ./internal/kmsstate/ ./internal/kmsrotate/ ./bootstrapper/kmskeeper/

bench-kms: ## Secret create/get/update latency through a real API server and etcd, plaintext vs encrypted through the KMS plugin; the plugin's own calls
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) \
	  $(GO) test -count=1 -run '^$$' -bench 'Secrets|Plugin' -benchtime 2000x -timeout 20m ./internal/kmsplugin/
