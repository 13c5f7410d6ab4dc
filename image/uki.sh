#!/usr/bin/env bash
# Assembles the image's unified kernel image: systemd-stub (Debian's systemd-boot-efi) with the tree's
# kernel, initrd and os-release and a kernel command line as PE sections, and computes the PCR values
# it will produce (berth policy measure) as a policy file next to it.
#
# Usage: image/uki.sh ROOT CMDLINE OUT.efi [MEASUREMENTS.yaml]
#
#   BERTH_CLI   the berth binary that computes the measurements (default: bin/berth)
#   UKI_STUB    systemd-stub                                   (default: Debian's path)
#
# The sections' addresses follow systemd's documented objcopy recipe: .osrel and .cmdline right after
# the stub's own sections, .linux at 32 MiB and .initrd after the kernel, aligned to 1 MiB. The UKI is
# unsigned; PCR 4 and PCR 11 identify it whatever the Secure Boot state.
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "image/uki.sh: $*" >&2; exit 1; }

[ $# -ge 3 ] || die "usage: uki.sh ROOT CMDLINE OUT.efi [MEASUREMENTS.yaml]"
root=$1 cmdline=$2 out=$3 measurements=${4:-}
stub=${UKI_STUB:-/usr/lib/systemd/boot/efi/linuxx64.efi.stub}
cli=${BERTH_CLI:-$IMAGE_DIR/../bin/berth}

[ -f "$stub" ] || die "no systemd-stub at $stub (Debian package systemd-boot-efi)"
command -v objcopy >/dev/null || die "objcopy is not installed (binutils)"
kernel=$(ls "$root"/boot/vmlinuz-* 2>/dev/null | sort -V | tail -n1)
[ -n "$kernel" ] || die "no kernel in $root/boot"
kver=${kernel##*/vmlinuz-}
initrd=$root/boot/initrd.img-$kver
[ -f "$initrd" ] || die "no initrd for $kver in $root/boot"
osrel=$root/usr/lib/os-release
[ -f "$osrel" ] || die "no $osrel"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '%s' "$cmdline" >"$work/cmdline"
ksize=$(stat -c %s "$kernel")
linux_vma=$((0x2000000))
initrd_vma=$(((linux_vma + ksize + 0xfffff) / 0x100000 * 0x100000))
objcopy \
	--add-section .osrel="$osrel" --change-section-vma .osrel=0x20000 \
	--add-section .cmdline="$work/cmdline" --change-section-vma .cmdline=0x30000 \
	--add-section .linux="$kernel" --change-section-vma .linux="$(printf '0x%x' $linux_vma)" \
	--add-section .initrd="$initrd" --change-section-vma .initrd="$(printf '0x%x' $initrd_vma)" \
	"$stub" "$out.tmp"
# objcopy stamps the PE header with the current time, which would make every build's UKI (and its
# PCR 4) different: the stamp is SOURCE_DATE_EPOCH, else 0, and the optional PE checksum (over the
# stamp) is 0, so the same inputs give the same UKI.
pe=$(od -An -tu4 -j60 -N4 "$out.tmp" | tr -d ' ')
stamp=${SOURCE_DATE_EPOCH:-0}
printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x' $((stamp & 255)) $((stamp >> 8 & 255)) $((stamp >> 16 & 255)) $((stamp >> 24 & 255)))" |
	dd of="$out.tmp" bs=1 seek=$((pe + 8)) conv=notrunc status=none
printf '\x00\x00\x00\x00' | dd of="$out.tmp" bs=1 seek=$((pe + 24 + 64)) conv=notrunc status=none
mv -f "$out.tmp" "$out"

if [ -n "$measurements" ]; then
	[ -x "$cli" ] || die "no berth binary at $cli (make build)"
	sum=$(sha256sum "$out" | cut -c1-16)
	# The boot phase PCR the tree's bootstrapper marks once its state disk is open (0: none).
	phase=$(sed -n 's/^BERTH_PHASE_PCR=//p' "$root/usr/lib/berth/bootstrapper.env" 2>/dev/null | tail -n1)
	"$cli" policy measure --uki "$out" --phase-pcr "${phase:-0}" --source "$(basename "$out") (kernel $kver, sha256 $sum...)" >"$measurements.tmp"
	mv -f "$measurements.tmp" "$measurements"
fi
echo "image/uki.sh: $out (kernel $kver, $(du -h "$out" | cut -f1))${measurements:+, measurements in $measurements}" >&2
