#!/usr/bin/env bash
# Installs the Debian packages Berth's build and tests need. Idempotent; a no-op when all are present.
set -euo pipefail
PKGS=(make git ca-certificates mkosi debootstrap debian-archive-keyring systemd systemd-boot-efi binutils squashfs-tools squashfs-tools-ng cryptsetup-bin fdisk dosfstools mtools qemu-utils qemu-system-x86 ovmf containerd runc containernetworking-plugins swtpm swtpm-tools nftables iproute2 util-linux procps tpm2-tools gcc libc6-dev prometheus)
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
command -v go >/dev/null || { echo "install-deps: Go is required (the machine image provides /usr/local/go)" >&2; exit 1; }
