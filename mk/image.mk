# OS image: a Debian bookworm root tree built with mkosi 14, with the bootstrapper,
# kubelet, kubeadm, containerd and the systemd units. See image/README.md.

IMAGE_OUT ?= $(CURDIR)/image/mkosi.output
IMAGE_ATTESTATION ?= tpm
IMAGE_METADATA ?= static
IMAGE_ROOT := $(IMAGE_OUT)/berth-root

.PHONY: image image-bootstrapper image-cli image-clean test-image

# The image needs only the bootstrapper. A TDX image opts in to go-tdx-qpl (AGPL-3.0, build tag
# berth_qpl) for the legacy /dev/tdx-guest backend; that bootstrapper binary then carries AGPL-3.0 code.
IMAGE_GO_TAGS := $(if $(filter tdx,$(IMAGE_ATTESTATION)),berth_qpl)
image-bootstrapper:
	CGO_ENABLED=0 $(GO) build -trimpath -tags '$(IMAGE_GO_TAGS)' -ldflags '$(LDFLAGS)' -o $(BIN)/ ./bootstrapper/cmd/bootstrapper

# berth policy measure computes the UKI's PCR values at build time.
image-cli:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/berth

# IMAGE_CMDLINE (optional) replaces the kernel options baked into the UKI after the dm-verity root's.
image: image-bootstrapper image-cli ## build the node image: root tree, dm-verity root, UKI berth.efi, its expected measurements, the bootable disk berth.raw/berth.qcow2 (needs root, mkosi, systemd-boot-efi, squashfs-tools, cryptsetup-bin, mtools)
	IMAGE_OUT=$(IMAGE_OUT) IMAGE_ATTESTATION=$(IMAGE_ATTESTATION) IMAGE_METADATA=$(IMAGE_METADATA) \
		BERTH_BOOTSTRAPPER=$(CURDIR)/$(BIN)/bootstrapper BERTH_CLI=$(CURDIR)/$(BIN)/berth image/build.sh

# The tree is rebuilt first (a few seconds when mkosi's OS cache is warm), so the tests always see
# the units as they are in image/.
# Then the disk boot test: berth.qcow2 under QEMU/TCG with OVMF and swtpm, attested from the host,
# and a disk with one byte of the bootstrapper changed, refused (minutes; under the e2e lock).
test-image: image ## systemd-analyze verify the units and check every path they reference in the built tree; boot berth.qcow2 and attest it
	BERTH_IMAGE_ROOT=$(IMAGE_ROOT) $(GO) test $(GOTEST_FLAGS) ./image/...
	$(MAKE) test-image-boot

.PHONY: test-image-boot
test-image-boot: ## boot the built berth.qcow2 under QEMU/TCG with OVMF and swtpm: LUKS2 state disk, berth verify accepts PCRs 4/9/11/12; a one-byte tampered root is refused (minutes)
	IMAGE_OUT=$(IMAGE_OUT) BOOT_WORK=$(IMAGE_OUT)/disk-boot BERTH_CLI=$(CURDIR)/$(BIN)/berth \
		flock /tmp/berth-e2e.lock image/disk-boot-test.sh

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

.PHONY: image-measured-boot-test
image-measured-boot-test: ## test-image-boot plus a boot of the disk with a UKI whose command line differs by one byte, which must be refused naming PCRs 4, 9 and 11 (manual, minutes)
	IMAGE_OUT=$(IMAGE_OUT) BOOT_WORK=$(IMAGE_OUT)/measured BERTH_CLI=$(CURDIR)/$(BIN)/berth CHANGED=1 \
		flock /tmp/berth-e2e.lock image/disk-boot-test.sh
