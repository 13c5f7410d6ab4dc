# The malicious-peer suite: package attack, go test ./attack/ (part of test-unit). It needs swtpm and
# the cached kube-apiserver and etcd (make mini-build). attack-flood runs its flood harness at full size: identity
# probes with random claims from FLOOD_ADDRESSES loopback addresses for FLOOD_DURATION while FLOOD_JOINS genuine
# nodes join from addresses metadata knows; it prints every genuine join's p50/p99 and the ledger afterwards, and
# ends with a line `flood_probes_per_s=... joins_ok=... join_p50_ms=... join_p99_ms=...`.
FLOOD_DURATION ?= 30s
FLOOD_ADDRESSES ?= 500
FLOOD_JOINS ?= 24
FLOOD_WORKERS ?=

.PHONY: test-attack attack-flood

test-attack: ## the malicious-peer suite against the real binaries (swtpm, a real API server)
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) \
		$(GO) test $(GOTEST_FLAGS) -v ./attack/

attack-flood: ## flood harness: probes from FLOOD_ADDRESSES addresses for FLOOD_DURATION, genuine joins' p50/p99, the ledger after
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) BERTH_ATTACK_FLOOD=1 \
	FLOOD_DURATION=$(FLOOD_DURATION) FLOOD_ADDRESSES=$(FLOOD_ADDRESSES) FLOOD_JOINS=$(FLOOD_JOINS) FLOOD_WORKERS=$(FLOOD_WORKERS) \
		$(GO) test -count=1 -timeout 30m -run '^TestFloodHarness$$' -v ./attack/
