# Joinservice: join ledger, rate limits, metrics, policy hot reload, control-plane Lease.
# Tests that need a real API server run the default release's etcd and kube-apiserver as loopback
# processes (internal/apiservertest); plain `go test ./...` runs them only when scripts/build-k8s.sh has built
# those binaries and skips them with a message otherwise. test-joinservice builds them first.

JOINSERVICE_PKGS := ./joinservice/... ./internal/joinledger/ ./internal/cli/

.PHONY: test-joinservice

test-joinservice: ## joinservice tests with the race detector, including those against a real kube-apiserver + etcd
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) \
		$(GO) test $(GOTEST_FLAGS) $(JOINSERVICE_PKGS)

# Load harness (joinservice/loadtest, see its package doc for exactly what it measures).
# BENCH_JOIN_MODE=attested (default): the real joinservice binary attesting with swtpm, a real
# kube-apiserver + etcd, and nodes that attest with software TPMs (TPM-format evidence under a test EK
# CA) over mutual attested TLS, one new connection per join. BENCH_JOIN_MODE=inprocess: the server
# code alone in the test process over plain gRPC (the ticket path without the handshake; knobs
# BENCH_JOIN_API=apiserver|fake, BENCH_JOIN_CA=ecdsa|rsa, BENCH_JOIN_CPUPROFILE=/abs/FILE).
# Both: BENCH_JOIN_DURATION (accepted phase; each rejected phase runs half), BENCH_JOIN_CLIENTS.
# Attested: BENCH_JOIN_IDENTITIES (software TPMs per client, used in turn), BENCH_JOIN_SESSION=1 (default:
# the nodes' join policy lists the cluster's attestation-key CA, so they take the joinservice's session
# proof; 0: they activate its key and it quotes on every join).
# The last line is `joins/s=<n> p50_ms=<n> p99_ms=<n> reject_cost_ratio=<n> server_ms_per_join=<n>` (attested:
# server = joinservice + its swtpm + kube-apiserver + etcd, CPU ms per accepted join). BENCH_JOIN_CHART (default
# bin/bench-join.png) gets a PNG chart of the phases: requests per second, p50 and p99 latency by second.
BENCH_JOIN_MODE ?= attested
BENCH_JOIN_API ?= apiserver
BENCH_JOIN_DURATION ?= 10s
BENCH_JOIN_CLIENTS ?= 16
BENCH_JOIN_IDENTITIES ?= 4
BENCH_JOIN_SESSION ?= 1
BENCH_JOIN_CA ?= ecdsa
BENCH_JOIN_CPUPROFILE ?=
BENCH_JOIN_CHART ?= $(CURDIR)/$(BIN)/bench-join.png
BENCH_JOIN_TEST = $(if $(filter inprocess,$(BENCH_JOIN_MODE)),TestJoinLoad,TestJoinLoadAttested)

.PHONY: bench-join
bench-join: ## join load harness: real joinservice binary + swtpm + API server, software-TPM nodes over mutual aTLS (see joinservice/loadtest)
	@test "$(BENCH_JOIN_MODE)" = attested || test "$(BENCH_JOIN_MODE)" = inprocess || { echo "BENCH_JOIN_MODE=$(BENCH_JOIN_MODE): want attested or inprocess" >&2; exit 2; }
	@mkdir -p $(dir $(BENCH_JOIN_CHART)) && BINS=$$(./scripts/build-k8s.sh k8s etcd) && out=$$(mktemp) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) BERTH_BENCH_JOIN=1 \
	BENCH_JOIN_API=$(BENCH_JOIN_API) BENCH_JOIN_DURATION=$(BENCH_JOIN_DURATION) BENCH_JOIN_CLIENTS=$(BENCH_JOIN_CLIENTS) BENCH_JOIN_CA=$(BENCH_JOIN_CA) \
	BENCH_JOIN_CPUPROFILE=$(BENCH_JOIN_CPUPROFILE) BENCH_JOIN_IDENTITIES=$(BENCH_JOIN_IDENTITIES) BENCH_JOIN_SESSION=$(BENCH_JOIN_SESSION) BENCH_JOIN_CHART=$(BENCH_JOIN_CHART) \
		$(GO) test -count=1 -timeout 60m -run '^$(BENCH_JOIN_TEST)$$' -v ./joinservice/loadtest/ > $$out 2>&1; rc=$$?; \
	grep -v '^joins/s=' $$out; line=$$(grep '^joins/s=' $$out | tail -1); rm -f $$out; \
	test $$rc -eq 0 && test -n "$$line" && echo "$$line"
