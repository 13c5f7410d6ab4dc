# TPM attestation, attested TLS and policy: internal/attestation/{policy,vtpm,tpmsim,choose}
# and internal/atls. Tests run on the reference simulator (cgo) and on swtpm processes with EK certificates
# from swtpm's local CA (apt: swtpm swtpm-tools); without them those tests skip.

ATTESTATION_PKGS := ./internal/atls/... ./internal/attestation/policy/... ./internal/attestation/vtpm/... \
	./internal/attestation/tpmsim/... ./internal/attestation/choose/...
ATTESTATION_FUZZTIME ?= 60s
# package:target pairs
ATTESTATION_FUZZ := internal/attestation/policy:FuzzParse internal/attestation/vtpm:FuzzParseDocument \
	internal/attestation/vtpm:FuzzParseEventLog internal/attestation/vtpm:FuzzChallenge internal/attestation/vtpm:FuzzDecodeAttest \
	internal/attestation/vtpm:FuzzDecodeSignature internal/attestation/vtpm:FuzzDecodePublic internal/attestation/vtpm:FuzzDecodeCreationData \
	internal/attestation/vtpm:FuzzDocumentDecoders internal/atls:FuzzCheckPeer \
	internal/atls:FuzzNonceCarriers internal/atls:FuzzClaims

.PHONY: test-attestation fuzz-attestation bench-attestation

test-attestation: ## TPM attestation, aTLS and policy tests with the race detector (simulator and swtpm)
	$(GO) test $(GOTEST_FLAGS) $(ATTESTATION_PKGS)
	$(GO) test $(GOTEST_FLAGS) -run 'TestVerify' ./internal/cli/

fuzz-attestation: ## run each attestation/aTLS/policy fuzz target for ATTESTATION_FUZZTIME (default 60s)
	@for pt in $(ATTESTATION_FUZZ); do \
		p=$${pt%%:*}; t=$${pt##*:}; echo "== $$p $$t"; \
		$(GO) test ./$$p/ -run '^$$' -fuzz "^$$t\$$" -fuzztime $(ATTESTATION_FUZZTIME) -fuzzminimizetime $(FUZZ_MINIMIZE) || exit 1; \
	done

# bench-attestation prints numbers, judges none: Issue, Validate (first contact and repeat), Challenge,
# Activate on the reference simulator and on swtpm; server-attests handshakes (accepted, first contact,
# rejected, refused); mutual handshakes on 8 goroutines (handshakes/s); and the production join RPC
# (joinservice server and node on swtpm each, a new connection and a new node validator per join).
ATTESTATION_BENCHTIME ?= 200x
ATTESTATION_BENCHCOUNT ?= 1
bench-attestation: ## Validate first contact/repeat, handshakes (mutual on 8 goroutines), the production join RPC: numbers, no verdicts
	$(GO) test -run '^$$' -bench . -benchtime $(ATTESTATION_BENCHTIME) -count $(ATTESTATION_BENCHCOUNT) ./internal/attestation/vtpm/ ./internal/atls/
	$(GO) test -run '^$$' -bench '^BenchmarkAttestedJoin$$' -benchtime $(ATTESTATION_BENCHTIME) -count $(ATTESTATION_BENCHCOUNT) ./joinservice/server/
