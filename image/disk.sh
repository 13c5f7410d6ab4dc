#!/usr/bin/env bash
# Writes the node's bootable disk: a GPT disk image with
#
#   1 berth-esp          EFI system partition (FAT32) with the UKI as \EFI\BOOT\BOOTX64.EFI
#   2 berth-root         the root file system (squashfs, read-only), protected by dm-verity
#   3 berth-root-verity  its dm-verity hash tree (the root hash is in the UKI's measured command line)
#   4 berth-state        empty: the boot stage formats it as LUKS2 with dm-integrity on the first boot
#
# and the same disk as qcow2. No loop device, no mount: each partition is made as a file and written
# at its offset. Partition and disk GUIDs are derived from the content, so the same inputs give the
# same bytes.
#
# Usage: image/disk.sh UKI ROOT.squashfs ROOT.verity OUT.raw [OUT.qcow2]
#
#   IMAGE_STATE_SIZE   size of the berth-state partition in MiB (default 128; grow it on the target)
#   IMAGE_ESP_SIZE     size of the EFI system partition in MiB  (default 64)
set -euo pipefail

die() { echo "image/disk.sh: $*" >&2; exit 1; }
[ $# -ge 4 ] || die "usage: disk.sh UKI ROOT.squashfs ROOT.verity OUT.raw [OUT.qcow2]"
uki=$1 data=$2 hash=$3 raw=$4 qcow=${5:-}
state_mib=${IMAGE_STATE_SIZE:-128}
esp_mib=${IMAGE_ESP_SIZE:-64}
for tool in sfdisk mkfs.vfat mmd mcopy; do
	command -v "$tool" >/dev/null || die "$tool is not installed (fdisk, dosfstools, mtools)"
done
[ -z "$qcow" ] || command -v qemu-img >/dev/null || die "qemu-img is not installed (qemu-utils)"

mib() { echo $((($(stat -c %s "$1") + 1048575) / 1048576)); }
uki_mib=$(mib "$uki")
((uki_mib + 2 <= esp_mib)) || die "the UKI ($uki_mib MiB) does not fit an EFI system partition of $esp_mib MiB (IMAGE_ESP_SIZE)"
data_mib=$(mib "$data") hash_mib=$(mib "$hash")

# GUIDs derived from the content (version-4 layout, so tools accept them).
seed=$(cat "$uki" "$hash" | sha256sum | cut -c1-64)
guid() {
	local h
	h=$(printf '%s/%s' "$seed" "$1" | sha256sum)
	echo "${h:0:8}-${h:8:4}-4${h:13:3}-a${h:17:3}-${h:20:12}"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The EFI system partition as a file: FAT32 with a fixed volume ID, files and directories stamped
# with SOURCE_DATE_EPOCH (else 1980-01-01, FAT's earliest date).
stamp=${SOURCE_DATE_EPOCH:-315532800}
export SOURCE_DATE_EPOCH=$stamp # mtools stamps directories and files with it
truncate -s "${esp_mib}M" "$work/esp.img"
mkfs.vfat -F 32 -n BERTH-ESP -i "${seed:0:8}" --invariant "$work/esp.img" >/dev/null
cp "$uki" "$work/BOOTX64.EFI"
touch -d "@$stamp" "$work/BOOTX64.EFI"
MTOOLS_SKIP_CHECK=1 mmd -i "$work/esp.img" ::/EFI ::/EFI/BOOT
MTOOLS_SKIP_CHECK=1 mcopy -m -i "$work/esp.img" "$work/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI

# Layout in MiB: 1 MiB for the primary GPT, the partitions, 1 MiB for the backup GPT.
esp_start=1
data_start=$((esp_start + esp_mib))
hash_start=$((data_start + data_mib))
state_start=$((hash_start + hash_mib))
total=$((state_start + state_mib + 1))
rm -f "$raw.tmp"
truncate -s "${total}M" "$raw.tmp"
sfdisk --quiet --no-reread --no-tell-kernel "$raw.tmp" <<TABLE
label: gpt
label-id: $(guid disk)
unit: sectors
first-lba: 2048
start=$((esp_start * 2048)), size=$((esp_mib * 2048)), type=C12A7328-F817-11D2-BA4B-00A0C93EC3B8, uuid=$(guid esp), name=berth-esp
start=$((data_start * 2048)), size=$((data_mib * 2048)), type=4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709, uuid=$(guid root), name=berth-root, attrs=GUID:60
start=$((hash_start * 2048)), size=$((hash_mib * 2048)), type=2C7357ED-EBD2-46D9-AEC1-23D437EC2BF5, uuid=$(guid verity), name=berth-root-verity, attrs=GUID:60
start=$((state_start * 2048)), size=$((state_mib * 2048)), type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, uuid=$(guid state), name=berth-state
TABLE
dd if="$work/esp.img" of="$raw.tmp" bs=1M seek="$esp_start" conv=notrunc,sparse status=none
dd if="$data" of="$raw.tmp" bs=1M seek="$data_start" conv=notrunc,sparse status=none
dd if="$hash" of="$raw.tmp" bs=1M seek="$hash_start" conv=notrunc,sparse status=none
mv -f "$raw.tmp" "$raw"
if [ -n "$qcow" ]; then
	qemu-img convert -f raw -O qcow2 "$raw" "$qcow.tmp"
	mv -f "$qcow.tmp" "$qcow"
fi
echo "image/disk.sh: $raw (${total} MiB: ESP $esp_mib, root $data_mib, verity $hash_mib, state $state_mib)${qcow:+ and $qcow ($(du -h "$qcow" | cut -f1))}" >&2
