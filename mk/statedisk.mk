# The encrypted state disk: internal/statedisk. The fscrypt backend's tests run for real
# (root, loop devices, ext4 encryption) in test-unit; the LUKS2 backend needs device-mapper, which only
# the OS image under QEMU has: test-luks runs it there (scripts/test-luks.sh).

.PHONY: test-statedisk test-luks bench-statedisk

test-statedisk: ## state disk tests with the race detector: fscrypt on a real loop-mounted image (root), LUKS2 against a cryptsetup model
	$(GO) test $(GOTEST_FLAGS) -v ./internal/statedisk/

test-luks: ## the LUKS2 state disk for real: cryptsetup, dm-crypt, dm-integrity on a loop device (root; a kernel with device-mapper; make image-luks-test runs it inside the OS image under QEMU)
	./scripts/test-luks.sh

bench-statedisk: ## fscrypt state disk: Format, Open+Close and Rekey on a 2 GiB sparse image (root)
	$(GO) test -run '^$$' -bench Fscrypt -benchtime 20x ./internal/statedisk/
