#!/usr/bin/env bash
# Exercises the LUKS2 backend of the state disk (internal/statedisk) for real: cryptsetup luksFormat
# with dm-integrity (hmac-sha256), open with a wrong and a right key, luksChangeKey, the header token,
# a second format, on a loop device. Needs root, cryptsetup and a kernel with device-mapper (dm-crypt,
# dm-integrity): the OS image under QEMU, not the mini cluster's hosts nor CI, which have no
# device-mapper and test this backend against a model of cryptsetup (`go test ./internal/statedisk`).
# Without its prerequisites it fails, it does not skip.
#
#   scripts/test-luks.sh                  build and run the test here (needs Go)
#   scripts/test-luks.sh --build OUT      only build the test binary OUT, e.g. to copy into a VM
#   STATEDISK_TEST_BIN=OUT scripts/test-luks.sh   run a test binary built before (no Go needed)
set -euo pipefail
cd "$(dirname "$0")/.."
pkg=./internal/statedisk
if [ "${1:-}" = --build ]; then
  exec go test -c -race -tags luks -o "${2:?usage: test-luks.sh --build OUT}" "$pkg"
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "test-luks: run as root: the test sets up loop and device-mapper devices" >&2
  exit 2
fi
for mod in dm_crypt dm_integrity loop; do
  modprobe "$mod" 2>/dev/null || true
done
if [ -n "${STATEDISK_TEST_BIN:-}" ]; then
  exec "$STATEDISK_TEST_BIN" -test.run '^TestLUKSReal$' -test.count 1 -test.v
fi
exec go test -race -count=1 -tags luks -run '^TestLUKSReal$' -v "$pkg"
