# TDX attestation: internal/attestation/tdx. No TDX hardware is needed: the backends run
# against simulated devices, verification against go-tdx-qpl's and go-tdx-guest's recorded sample quotes and
# collateral and against quotes from the software TD in tdxtest; TestDifferentialGoTDXGuest holds Berth's verifier
# to go-tdx-guest's verdict on all of them. test-tdx-cluster runs the installer's side: the joinservice DaemonSet
# of a TDX control plane (internal/berthsystem) and the joinservice binary run from it against a real
# kube-apiserver, configfs-tsm served by the software TD over FUSE.

TDX_PKG := ./internal/attestation/tdx/...
TDX_FUZZTIME ?= 60s
TDX_FUZZ_TARGETS := FuzzParseDocument FuzzParseQuote FuzzPCKChain FuzzVerifyQuote FuzzCollateral

.PHONY: test-tdx test-tdx-cluster fuzz-tdx bench-tdx

test-tdx: ## TDX attestation unit tests with the race detector
	$(GO) test $(GOTEST_FLAGS) $(TDX_PKG)

test-tdx-cluster: ## the TDX control plane's joinservice as the installer builds it, against a real kube-apiserver + etcd
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) \
		$(GO) test $(GOTEST_FLAGS) -run 'TDX|Variant' ./internal/berthsystem/ ./joinservice/cmd/joinservice/

fuzz-tdx: ## run each TDX fuzz target for TDX_FUZZTIME (default 60s)
	@for t in $(TDX_FUZZ_TARGETS); do \
		echo "== $$t"; \
		$(GO) test ./internal/attestation/tdx/ -run '^$$' -fuzz "^$$t\$$" -fuzztime $(TDX_FUZZTIME) -fuzzminimizetime $(FUZZ_MINIMIZE) || exit 1; \
	done

bench-tdx: ## TDX issue and validate benchmarks
	$(GO) test ./internal/attestation/tdx/ -run '^$$' -bench . -benchmem
