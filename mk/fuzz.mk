# Fuzzing: every fuzz target of the repository as package:target pairs. make test runs each one for
# FUZZ_SHORT_TIME (fuzz-short) and prints its executions per second; make fuzz FUZZ_TIME=10m runs them longer.
# New interesting inputs are minimized for at most FUZZ_MINIMIZE executions each: minimizing a 5 KiB quote for
# go test's default of 60 s is what kept the TDX targets at a few executions a minute.
# Go 1.26's fuzz coordinator can fail a target with a bare "context deadline exceeded" when -fuzztime ends
# (go.dev/issue/75804, fixed in Go 1.27): such a run, and only one that wrote no failing input under
# testdata/fuzz, is repeated once; a second failure, or any other, fails the target.

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
		for try in 1 2; do \
			before=$$(ls $$p/testdata/fuzz/$$t 2>/dev/null | wc -l); \
			$(GO) test ./$$p/ -run '^$$' -fuzz "^$$t\$$" -fuzztime $(1) -fuzzminimizetime $(2) > $$out 2>&1; rc=$$?; \
			cat $$out; [ $$rc -eq 0 ] && break; \
			after=$$(ls $$p/testdata/fuzz/$$t 2>/dev/null | wc -l); \
			if [ $$try -eq 1 ] && [ "$$after" = "$$before" ] && grep -qx '    context deadline exceeded' $$out; then \
				echo "== $$p $$t: Go's fuzz coordinator reported its own -fuzztime deadline as a failure (go.dev/issue/75804, fixed in Go 1.27) and wrote no failing input: running the target once more"; \
				continue; fi; \
			exit $$rc; \
		done; \
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
