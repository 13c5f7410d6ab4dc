# TDX attestation: internal/attestation/tdx. No TDX hardware is needed: the backends run
# against simulated devices, verification against go-tdx-qpl's recorded sample quote and collateral and against
# quotes from the software TD in tdxtest.

TDX_PKG := ./internal/attestation/tdx/...
TDX_FUZZTIME ?= 60s
TDX_FUZZ_TARGETS := FuzzParseDocument FuzzParseQuote FuzzPCKChain FuzzVerifyQuote FuzzCollateral

.PHONY: test-tdx fuzz-tdx bench-tdx

test-tdx: ## TDX attestation unit tests with the race detector
	$(GO) test $(GOTEST_FLAGS) $(TDX_PKG)

fuzz-tdx: ## run each TDX fuzz target for TDX_FUZZTIME (default 60s)
	@for t in $(TDX_FUZZ_TARGETS); do \
		echo "== $$t"; \
		$(GO) test ./internal/attestation/tdx/ -run '^$$' -fuzz "^$$t\$$" -fuzztime $(TDX_FUZZTIME) -fuzzminimizetime $(FUZZ_MINIMIZE) || exit 1; \
	done

bench-tdx: ## TDX issue and validate benchmarks
	$(GO) test ./internal/attestation/tdx/ -run '^$$' -bench . -benchmem
