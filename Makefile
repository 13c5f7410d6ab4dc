# Berth build entry points. `make help` lists the targets.
SHELL := /bin/bash
GO ?= go
BIN := bin
TOOLS_BIN := $(CURDIR)/.tools/bin
VERSION ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -s -w -X github.com/berth-k8s/berth/internal/version.Version=$(VERSION)
GOTEST_FLAGS ?= -race -count=1

.PHONY: help build test test-unit lint generate check-generate tools clean

help: ## list targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-18s %s\n", $$1, $$2}'

# Release builds use the tag berthrelease, which keeps the TPM reference simulator out. go-tdx-qpl
# (AGPL-3.0) is linked only into a build that opts in with the tag berth_qpl: no binary `make build`
# makes carries it (`make lint` checks), and only a TDX image's bootstrapper opts in (mk/image.mk).
BINARIES := ./cmd/berth ./cmd/berth-webhook ./joinservice/cmd/joinservice ./bootstrapper/cmd/bootstrapper

build: ## build every binary into bin/
	CGO_ENABLED=0 $(GO) build -trimpath -tags berthrelease -ldflags '$(LDFLAGS)' -o $(BIN)/ $(BINARIES)

tools: ## build pinned tools (buf, protoc plugins, staticcheck) into .tools/bin
	cd tools && GOBIN=$(TOOLS_BIN) $(GO) install tool

generate: tools ## regenerate protobuf code with buf
	PATH=$(TOOLS_BIN):$$PATH buf generate

check-generate: generate ## fail if generated code is out of date
	@git diff --exit-code -- initproto joinproto || { echo "generated code is stale: run make generate and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- initproto joinproto)" || { git status --porcelain -- initproto joinproto; echo "untracked generated files"; exit 1; }

lint: tools ## go vet, gofmt, staticcheck, a package doc on every package, no util/common packages
	$(GO) vet ./...
	@missing=$$($(GO) list -f '{{if not .Doc}}{{.ImportPath}}{{end}}' ./... | grep -v '^$$' || true); \
	  test -z "$$missing" || { echo "packages without a package doc comment:"; echo "$$missing"; exit 1; }
	@bad=$$($(GO) list -f '{{.Name}} {{.ImportPath}}' ./... | awk '$$1 ~ /^(util|utils|common|misc|helpers|types)$$/ {print $$2}'); \
	  test -z "$$bad" || { echo "packages with a name that says nothing:"; echo "$$bad"; exit 1; }
	@logs=$$(git ls-files '*.go' | grep -v _test.go | xargs grep -nE '\.(Debug|Info|Warn|Error)\((fmt\.Sprint|"[^"]*" *\+)' || true); \
	  test -z "$$logs" || { echo "log messages must be constants (put values in fields):"; echo "$$logs"; exit 1; }
	@out=$$(gofmt -l $$(git ls-files '*.go')); test -z "$$out" || { echo "gofmt needed:"; echo "$$out"; exit 1; }
	$(TOOLS_BIN)/staticcheck ./...
	@for p in $(BINARIES); do \
	  if $(GO) list -deps -tags berthrelease $$p | grep -q '^github.com/edgelesssys/go-tdx-qpl'; then \
	    echo "$$p links go-tdx-qpl (AGPL-3.0) without the opt-in build tag berth_qpl"; exit 1; fi; done

test-unit: ## unit and package tests with the race detector (and the TDX package once more with go-tdx-qpl opted in)
	$(GO) test $(GOTEST_FLAGS) ./...
	$(GO) test $(GOTEST_FLAGS) -tags berth_qpl ./internal/attestation/tdx/

test: check-generate lint build test-unit test-image test-e2e ## everything CI runs (root: the image and e2e targets need it)

clean: ## remove build output
	rm -rf $(BIN) .tools

-include mk/*.mk
