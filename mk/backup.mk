# Backups: the cluster's sealed etcd snapshots (internal/backup), against a real etcd and API server
# and a real S3-compatible object store (versitygw) where they are built.

.PHONY: test-backup

test-backup: ## backup tests with the race detector: sealing, a real etcd's snapshot, the local and S3 stores
	BERTH_KUBE_BIN=$$(./scripts/build-k8s.sh k8s) BERTH_ETCD_BIN=$$(./scripts/build-k8s.sh etcd) \
	BERTH_VERSITYGW_BIN=$$(./scripts/build-k8s.sh versitygw) \
	  $(GO) test $(GOTEST_FLAGS) ./internal/backup/...
