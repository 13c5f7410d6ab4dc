# Berth build entry points. `make help` lists the targets.
SHELL := /bin/bash
GO ?= go
BIN := bin
TOOLS_BIN := $(CURDIR)/.tools/bin
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
# `berth version` shows these. The build date is the source date of reproducible builds:
# SOURCE_DATE_EPOCH when set, else the commit's date, so that one commit always builds the same binary.
GIT_COMMIT ?= $(shell c=$$(git rev-parse HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null && echo $$c || echo $$c-dirty; })
BUILD_DATE ?= $(shell d=$${SOURCE_DATE_EPOCH:-$$(git log -1 --format=%ct 2>/dev/null)}; [ -n "$$d" ] && date -u -d @$$d +%Y-%m-%dT%H:%M:%SZ)
VERSION_PKG := github.com/berth-k8s/berth/internal/version
LDFLAGS := -s -w -X $(VERSION_PKG).Version=$(VERSION) -X $(VERSION_PKG).GitCommit=$(GIT_COMMIT) -X $(VERSION_PKG).BuildDate=$(BUILD_DATE)
GOTEST_FLAGS ?= -race -count=1
# A race-enabled test binary sleeps 1 s before it exits so that late reports get out; every package
# that starts goroutines checks for leaks (goleak), so nothing should run that late. Saves ~1 s a package.
export GORACE ?= atexit_sleep_ms=0

.PHONY: help build test test-unit lint generate check-generate clusterconfig-docs reasons-docs tools clean

help: ## list targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

# Release builds use the tag berthrelease, which keeps the TPM reference simulator out. go-tdx-qpl
# (AGPL-3.0) is linked only into a build that opts in with the tag berth_qpl: no binary `make build`
# makes carries it (`make lint` checks), and only a TDX image's bootstrapper opts in (mk/image.mk).
BINARIES := ./cmd/berth ./cmd/berth-webhook ./joinservice/cmd/joinservice ./bootstrapper/cmd/bootstrapper

build: ## build every binary into bin/
	CGO_ENABLED=0 $(GO) build -trimpath -tags berthrelease -ldflags '$(LDFLAGS)' -o $(BIN)/ $(BINARIES)

tools: ## build pinned tools (buf, protoc plugins; golangci-lint in its own module) into .tools/bin
	cd tools && GOBIN=$(TOOLS_BIN) $(GO) install tool
	cd tools/golangci && GOBIN=$(TOOLS_BIN) $(GO) install tool

generate: tools ## regenerate protobuf code with buf
	PATH=$(TOOLS_BIN):$$PATH buf generate

check-generate: generate generate-records ## fail if generated code is out of date
	$(GO) test -count=1 -run '^TestReferenceCurrent$$' ./internal/clusterconfig/ ./internal/reasons/
	@git diff --exit-code -- initproto joinproto recoverproto internal/records || { echo "generated code is stale: run make generate generate-records and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- initproto joinproto recoverproto internal/records)" || { git status --porcelain -- initproto joinproto recoverproto internal/records; echo "untracked generated files"; exit 1; }

clusterconfig-docs: ## regenerate the cluster configuration's reference and JSON schema from its types
	$(GO) test -count=1 -run '^TestReferenceCurrent$$' ./internal/clusterconfig/ -update

reasons-docs: ## regenerate internal/reasons/REASONS.md from the reason table
	$(GO) test -count=1 -run '^TestReferenceCurrent$$' ./internal/reasons/ -update

# buf breaking compares the protocols with those on this branch: main (BUF_AGAINST overrides it).
BUF_AGAINST ?= .git\#branch=main

lint: tools ## vet, gofmt, golangci-lint (.golangci.yml), go mod tidy -diff, the import rules, buf lint + breaking, package docs, names, log messages, no AGPL in release binaries
	$(GO) vet ./...
	@missing=$$($(GO) list -f '{{if not .Doc}}{{.ImportPath}}{{end}}' ./... | grep -v '^$$' || true); \
	  test -z "$$missing" || { echo "packages without a package doc comment:"; echo "$$missing"; exit 1; }
	@bad=$$($(GO) list -f '{{.Name}} {{.ImportPath}}' ./... | awk '$$1 ~ /^(util|utils|common|misc|helpers|types)$$/ {print $$2}'); \
	  test -z "$$bad" || { echo "packages with a name that says nothing:"; echo "$$bad"; exit 1; }
	@logs=$$(git ls-files '*.go' | grep -v _test.go | xargs grep -nE '\.(Debug|Info|Warn|Error)\((fmt\.Sprint|"[^"]*" *\+)' || true); \
	  test -z "$$logs" || { echo "log messages must be constants (put values in fields):"; echo "$$logs"; exit 1; }
	@out=$$(gofmt -l $$(git ls-files '*.go')); test -z "$$out" || { echo "gofmt needed:"; echo "$$out"; exit 1; }
	@for p in $(BINARIES); do \
	  if $(GO) list -deps -tags berthrelease $$p | grep -q '^github.com/edgelesssys/go-tdx-qpl'; then \
	    echo "$$p links go-tdx-qpl (AGPL-3.0) without the opt-in build tag berth_qpl"; exit 1; fi; done
	$(GO) mod tidy -diff
	$(GO) test -count=1 -run '^TestImportRules' .
	$(GO) test -count=1 -run '^TestDoc' .
	$(TOOLS_BIN)/golangci-lint run --allow-serial-runners ./...
	$(TOOLS_BIN)/buf lint
	@against='$(BUF_AGAINST)'; git rev-parse -q --verify main >/dev/null || against='.git#ref=HEAD'; \
	  echo "$(TOOLS_BIN)/buf breaking --against $$against"; $(TOOLS_BIN)/buf breaking --against "$$against"

test-unit: ## unit and package tests with the race detector (and the TDX package once more with go-tdx-qpl opted in)
	$(GO) test $(GOTEST_FLAGS) ./...
	$(GO) test $(GOTEST_FLAGS) -tags berth_qpl ./internal/attestation/tdx/

test: check-generate lint check-monitoring build mini-build test-unit fuzz-short test-image test-e2e ## everything CI runs, in the order scripts/test.sh times it (root: the image and e2e targets need it; mini-build first so the API-server tests run)

clean: ## remove build output
	rm -rf $(BIN) .tools

-include mk/*.mk
