# Mini cluster targets: `make mini-up` starts a local cluster of namespace nodes,
# `make test-e2e` runs the end-to-end tests on one. Both need root.
MINI_DIR ?= /var/lib/berth-mini
MINI_FLAGS ?= --control-planes 1 --workers 2

.PHONY: mini mini-deps mini-build mini-up mini-down mini-restart test-e2e

mini: mini-deps mini-up ## on a fresh machine: install packages, build everything, start a 3-node cluster (root)

mini-deps: ## install the Debian packages the mini cluster needs (idempotent)
	./scripts/install-deps.sh

mini-build: ## build Kubernetes, etcd, CoreDNS, flannel and the pod binaries at every supported Kubernetes version, and the backup tests' object store (cached by version)
	./scripts/build-k8s.sh >/dev/null
	for v in $$(./scripts/build-k8s.sh --supported); do ./scripts/build-k8s.sh --kubernetes-version $$v k8s etcd coredns >/dev/null || exit 1; done
	./scripts/build-k8s.sh versitygw >/dev/null

mini-up: build mini-build ## start a mini cluster in MINI_DIR (root)
	$(BIN)/berth mini up --dir $(MINI_DIR) $(MINI_FLAGS)

mini-down: build ## remove the mini cluster in MINI_DIR (root)
	$(BIN)/berth mini down --dir $(MINI_DIR)

mini-restart: build ## power-cycle every node of the mini cluster in MINI_DIR (root)
	$(BIN)/berth mini restart --dir $(MINI_DIR)

# The e2e tests `make test` runs: the cluster itself, attested init, the rejection of a tampered
# worker, and the image-policy webhook (rollout restarts under load, every backend gone, a power cut, the
# installer's re-check after a restart), and three control planes (serialized joins, the loss of the
# init node, node removal and revocation, certificates that renew themselves without the init node),
# a cluster at the previous supported Kubernetes minor (about 2 min), and the restore drill (a
# snapshot of 3 control planes + 1 worker restored into fresh nodes with berth restore, about 3 min).
E2E_RUN ?= TestMiniCluster|TestMiniAttestedInit|TestMiniTamperedWorkerRejected|TestMiniWebhook|TestMiniHA|TestMiniPreviousMinor|TestMiniRestore

test-e2e: build mini-build ## end-to-end tests on a real mini cluster (root; build tag e2e; E2E_RUN selects)
	$(GO) test -tags e2e -count=1 -v -timeout 60m -run '$(E2E_RUN)' ./e2e/...

# TestMiniHA alone: three control planes, the init node lost, removal and revocation, then the
# certificates renewing themselves on the cluster without its init node (also part of make test).
.PHONY: test-e2e-ha
test-e2e-ha: build mini-build ## only TestMiniHA (part of make test, about 16 min): 3 control planes, cp1 lost for good, node remove/readmit, then kubelet serving CSRs, caBundle repair, webhook renewals and a CA rotation under load beside control-plane certificate renewals (root)
	$(GO) test -tags e2e -count=1 -v -timeout 45m -run '^TestMiniHA$$' ./e2e/...

# TestMiniRestore alone: the restore drill (also part of make test).
.PHONY: test-e2e-restore
test-e2e-restore: build mini-build ## only TestMiniRestore (part of make test): a snapshot of a 3 control plane + 1 worker cluster with a canary Secret restored with berth restore into fresh nodes, the canary read back, the nodes joined, restore-to-Ready time printed (root)
	$(GO) test -tags e2e -count=1 -v -timeout 40m -run '^TestMiniRestore$$' ./e2e/...
