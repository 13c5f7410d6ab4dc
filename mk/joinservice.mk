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

# Load harness (joinservice/loadtest, see its package doc for exactly what it measures). Knobs:
# BENCH_JOIN_API=apiserver|fake (where the ledger writes), BENCH_JOIN_DURATION (accepted phase; the
# rejected phase runs half), BENCH_JOIN_CLIENTS, BENCH_JOIN_CA=ecdsa|rsa (the cluster CA key; berth init
# makes it ECDSA P-256, kubeadm's own default is RSA-2048), BENCH_JOIN_CPUPROFILE=/abs/FILE (CPU profile of the accepted phase).
# Worker tickets carry no bootstrap token, so the production configuration writes only the batched
# ledger to the API server. The last line is `joins/s=<n> p50_ms=<n> p99_ms=<n> reject_cost_ratio=<n>`.
BENCH_JOIN_API ?= apiserver
BENCH_JOIN_DURATION ?= 10s
BENCH_JOIN_CLIENTS ?= 16
BENCH_JOIN_CA ?= ecdsa
BENCH_JOIN_CPUPROFILE ?=

.PHONY: bench-join
bench-join: ## join load harness: the real server over loopback gRPC, the ledger in a real API server (see joinservice/loadtest)
	@BINS=$$(./scripts/build-k8s.sh k8s etcd) && out=$$(mktemp) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) BERTH_BENCH_JOIN=1 \
	BENCH_JOIN_API=$(BENCH_JOIN_API) BENCH_JOIN_DURATION=$(BENCH_JOIN_DURATION) BENCH_JOIN_CLIENTS=$(BENCH_JOIN_CLIENTS) BENCH_JOIN_CA=$(BENCH_JOIN_CA) \
	BENCH_JOIN_CPUPROFILE=$(BENCH_JOIN_CPUPROFILE) \
		$(GO) test -count=1 -timeout 60m -run '^TestJoinLoad$$' -v ./joinservice/loadtest/ > $$out 2>&1; rc=$$?; \
	grep -v '^joins/s=' $$out; line=$$(grep '^joins/s=' $$out | tail -1); rm -f $$out; \
	test $$rc -eq 0 && test -n "$$line" && echo "$$line"
