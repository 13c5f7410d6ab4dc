# Fuzzing: every fuzz target of the repository as package:target pairs. make test runs each one for
# FUZZ_SHORT_TIME (fuzz-short) and prints its executions per second; make fuzz FUZZ_TIME=10m runs them longer.
# New interesting inputs are minimized for at most FUZZ_MINIMIZE executions each: minimizing a 5 KiB quote for
# go test's default of 60 s is what kept the TDX targets at a few executions a minute.

FUZZ_TARGETS = $(ATTESTATION_FUZZ) $(addprefix internal/attestation/tdx:,$(TDX_FUZZ_TARGETS)) \
	joinservice/ca:FuzzSignKubeletClient joinservice/ca:FuzzSignKubeletClientRequests \
	bootstrapper/initserver:FuzzParseRequest
FUZZ_SHORT_TIME ?= 3s
FUZZ_TIME ?= 60s
FUZZ_MINIMIZE ?= 100x

.PHONY: fuzz fuzz-short

# run-fuzz TIME MINIMIZE: each target in turn; a table of total executions and executions per second at the end.
define run-fuzz
	@out=$$(mktemp) && trap 'rm -f $$out' EXIT && table="" && for pt in $(FUZZ_TARGETS); do \
		p=$${pt%%:*}; t=$${pt##*:}; echo "== $$p $$t"; \
		$(GO) test ./$$p/ -run '^$$' -fuzz "^$$t\$$" -fuzztime $(1) -fuzzminimizetime $(2) > $$out 2>&1; rc=$$?; \
		cat $$out; [ $$rc -eq 0 ] || exit $$rc; \
		last=$$(grep -E '^fuzz: elapsed: [0-9]+s, execs: [0-9]+' $$out | tail -1); \
		if [ -z "$$last" ]; then line="baseline coverage of the cached corpus only"; else \
			secs=$$(echo "$$last" | sed -E 's/^fuzz: elapsed: ([0-9]+)s.*/\1/'); execs=$$(echo "$$last" | sed -E 's/.*execs: ([0-9]+).*/\1/'); \
			line=$$(printf '%10s execs %8s/s' "$$execs" "$$(( execs / (secs > 0 ? secs : 1) ))"); fi; \
		table="$$table$$(printf '%-26s %-32s %s' $$p $$t "$$line")\n"; \
	done; printf "== executions per target:\n$$table"
endef

fuzz-short: ## every fuzz target for FUZZ_SHORT_TIME (default 3s; part of make test), with executions per second
	$(call run-fuzz,$(FUZZ_SHORT_TIME),0)

fuzz: ## every fuzz target for FUZZ_TIME (default 60s), with executions per second
	$(call run-fuzz,$(FUZZ_TIME),$(FUZZ_MINIMIZE))
