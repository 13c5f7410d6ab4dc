# OS image (issue 7): a Debian bookworm root tree built with mkosi 14, with the bootstrapper,
# kubelet, kubeadm, containerd and the systemd units. See image/README.md.

IMAGE_OUT ?= $(CURDIR)/image/mkosi.output
IMAGE_ATTESTATION ?= tpm
IMAGE_METADATA ?= static
IMAGE_ROOT := $(IMAGE_OUT)/berth-root

.PHONY: image image-bootstrapper image-clean test-image

# The image needs only the bootstrapper. A TDX image opts in to go-tdx-qpl (AGPL-3.0, build tag
# berth_qpl) for the legacy /dev/tdx-guest backend; that bootstrapper binary then carries AGPL-3.0 code.
IMAGE_GO_TAGS := $(if $(filter tdx,$(IMAGE_ATTESTATION)),berth_qpl)
image-bootstrapper:
	CGO_ENABLED=0 $(GO) build -trimpath -tags '$(IMAGE_GO_TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/ ./bootstrapper/cmd/bootstrapper

image: image-bootstrapper ## build the node image's root tree into image/mkosi.output/berth-root (needs root and mkosi)
	IMAGE_OUT=$(IMAGE_OUT) IMAGE_ATTESTATION=$(IMAGE_ATTESTATION) IMAGE_METADATA=$(IMAGE_METADATA) \
		BERTH_BOOTSTRAPPER=$(CURDIR)/$(BIN)/bootstrapper image/build.sh

# The tree is rebuilt first (a few seconds when mkosi's OS cache is warm), so the tests always see
# the units as they are in image/.
test-image: image ## systemd-analyze verify the units and check every path they reference in the built tree
	BERTH_IMAGE_ROOT=$(IMAGE_ROOT) $(GO) test $(GOTEST_FLAGS) ./image/...

image-clean: ## remove the built tree and the image's OS cache (Debian packages stay cached)
	rm -rf $(IMAGE_OUT)
	rm -rf $${BERTH_CACHE:-/var/cache/berth}/image/os-*

.PHONY: image-boot-test
image-boot-test: ## boot the built tree under QEMU/TCG with swtpm and check the units at run time (minutes; needs qemu-system-x86, swtpm)
	IMAGE_ROOT=$(IMAGE_ROOT) BOOT_WORK=$(IMAGE_OUT)/boot image/boot-test.sh

.PHONY: image-luks-test
image-luks-test: ## the state disk's LUKS2 backend for real (cryptsetup, dm-crypt, dm-integrity) inside the built tree under QEMU/TCG (minutes; needs qemu-system-x86)
	IMAGE_ROOT=$(IMAGE_ROOT) LUKS_WORK=$(IMAGE_OUT)/luks image/luks-test.sh

.PHONY: image-init-test
image-init-test: ## berth init a one-node cluster on the booted image (QEMU/TCG; needs BOOT_IMAGES=archives of the control-plane and joinservice images)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/berth
	IMAGE_ROOT=$(IMAGE_ROOT) BOOT_WORK=$(IMAGE_OUT)/init BERTH_CLI=$(CURDIR)/$(BIN)/berth image/init-test.sh
