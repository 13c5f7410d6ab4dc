# TPM attestation, attested TLS and policy (issue 3, TPM half): internal/attestation/{policy,vtpm,tpmsim,choose}
# and internal/atls. Tests run on the reference simulator (cgo) and on swtpm processes with EK certificates
# from swtpm's local CA (apt: swtpm swtpm-tools); without them those tests skip.

ATTESTATION_PKGS := ./internal/atls/... ./internal/attestation/policy/... ./internal/attestation/vtpm/... \
	./internal/attestation/tpmsim/... ./internal/attestation/choose/...
ATTESTATION_FUZZTIME ?= 60s
# package:target pairs
ATTESTATION_FUZZ := internal/attestation/policy:FuzzParse internal/attestation/vtpm:FuzzParseDocument \
	internal/attestation/vtpm:FuzzParseEventLog internal/attestation/vtpm:FuzzChallenge internal/atls:FuzzCheckPeer internal/atls:FuzzNonceCarriers internal/atls:FuzzClaims

.PHONY: test-attestation fuzz-attestation bench-attestation

test-attestation: ## TPM attestation, aTLS and policy tests with the race detector (simulator and swtpm)
	$(GO) test $(GOTEST_FLAGS) $(ATTESTATION_PKGS)
	$(GO) test $(GOTEST_FLAGS) -run 'TestVerify' ./internal/cli/

fuzz-attestation: ## run each attestation/aTLS/policy fuzz target for ATTESTATION_FUZZTIME (default 60s)
	@for pt in $(ATTESTATION_FUZZ); do \
		p=$${pt%%:*}; t=$${pt##*:}; echo "== $$p $$t"; \
		$(GO) test ./$$p/ -run '^$$' -fuzz "^$$t\$$" -fuzztime $(ATTESTATION_FUZZTIME) || exit 1; \
	done

bench-attestation: ## issue/validate latency per TPM backend and full/rejected/refused aTLS handshake cost
	$(GO) test -run '^$$' -bench . -benchtime 200x ./internal/attestation/vtpm/ ./internal/atls/
