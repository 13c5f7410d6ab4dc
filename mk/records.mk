# Records: the custom resources of Berth's record API (internal/records, group records.berth.dev).
# The deep copies, the typed clientset and the typed apply configurations are generated from the
# types in internal/records/v1alpha1 by k8s.io/code-generator at the version of the Kubernetes
# modules; check-generate fails when the committed code differs.

CODEGEN_VERSION := v0.34.2
RECORDS_PKG := github.com/berth-k8s/berth/internal/records
RECORDS_GEN := internal/records/v1alpha1/zz_generated.deepcopy.go internal/records/clientset internal/records/applyconfiguration

.PHONY: generate-records test-records

generate-records: ## regenerate the record API's deep copies, typed clientset and apply configurations
	# Generated files carry the generators' header; the hand-written package docs stay.
	grep -rlZ '^// Code generated' $(RECORDS_GEN) 2>/dev/null | xargs -0r rm -f
	$(GO) run k8s.io/code-generator/cmd/deepcopy-gen@$(CODEGEN_VERSION) --go-header-file /dev/null \
		--output-file zz_generated.deepcopy.go $(RECORDS_PKG)/v1alpha1
	$(GO) run k8s.io/code-generator/cmd/applyconfiguration-gen@$(CODEGEN_VERSION) --go-header-file /dev/null \
		--output-dir internal/records/applyconfiguration --output-pkg $(RECORDS_PKG)/applyconfiguration \
		$(RECORDS_PKG)/v1alpha1
	$(GO) run k8s.io/code-generator/cmd/client-gen@$(CODEGEN_VERSION) --go-header-file /dev/null \
		--fake-clientset=false --clientset-name clientset \
		--input-base github.com/berth-k8s/berth/internal --input records/v1alpha1 \
		--apply-configuration-package $(RECORDS_PKG)/applyconfiguration \
		--output-dir internal/records --output-pkg $(RECORDS_PKG)
	gofmt -w $(RECORDS_GEN)

test-records: ## the record API against a real kube-apiserver: CRDs, typed clients, the joinservice's writers
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) \
		$(GO) test $(GOTEST_FLAGS) ./internal/records/... ./joinservice/recordwriter/

# Load harness of the records (joinservice/loadtest TestRecordsLoad): BENCH_RECORDS_MACHINES distinct
# machines admitted through a real kube-apiserver into the record API, then into the machine record
# ConfigMap, with admissions per second and API requests per admission per chunk, heap, and the
# latency of berth status.
BENCH_RECORDS_MACHINES ?= 10000

.PHONY: bench-records
bench-records: ## records load harness: distinct machines admitted into the record API and into the machine record ConfigMap, through a real API server
	BINS=$$(./scripts/build-k8s.sh k8s etcd) && \
	BERTH_KUBE_BIN=$$(echo "$$BINS" | sed -n 1p) BERTH_ETCD_BIN=$$(echo "$$BINS" | sed -n 2p) BERTH_BENCH_RECORDS=1 \
	BENCH_RECORDS_MACHINES=$(BENCH_RECORDS_MACHINES) \
		$(GO) test -count=1 -timeout 60m -run '^TestRecordsLoad$$' -v ./joinservice/loadtest/
