# Joinservice (issue 5): join ledger, rate limits, metrics, policy hot reload, control-plane Lease.
# Tests that need a real API server run etcd 3.6.5 and kube-apiserver v1.34.2 as loopback processes
# (joinservice/apiservertest); plain `go test ./...` runs them only when scripts/build-k8s.sh has built
# those binaries and skips them with a message otherwise. test-joinservice builds them first.

JOINSERVICE_PKGS := ./joinservice/... ./internal/cli/

.PHONY: test-joinservice

test-joinservice: ## joinservice tests with the race detector, including those against a real kube-apiserver + etcd
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) \
		$(GO) test $(GOTEST_FLAGS) $(JOINSERVICE_PKGS)
