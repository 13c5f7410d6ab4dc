#!/usr/bin/env bash
# Runs the state disk's LUKS2 backend test (internal/statedisk, TestLUKSReal: cryptsetup, dm-crypt,
# dm-integrity on a loop device) inside the OS image under QEMU/TCG, whose Debian kernel has
# device-mapper, and prints its output and timings. The hosts Berth's CI runs on have no
# device-mapper, so this is a manual target (`make image-luks-test`, after `make image`), not part of
# `make test`.
#
#   IMAGE_ROOT     the tree to boot            (default: image/mkosi.output/berth-root)
#   LUKS_WORK      scratch dir                 (default: image/mkosi.output/luks)
#   LUKS_TIMEOUT   seconds to wait for the guest (default: 1200)
#
# The guest's disk is an ext4 file system made from the tree plus the test binary and a oneshot unit
# that runs it and powers off; the bootstrapper is masked (the guest has no berth-state partition).
# The guest has no network.
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${IMAGE_ROOT:-$IMAGE_DIR/mkosi.output/berth-root}
WORK=${LUKS_WORK:-$IMAGE_DIR/mkosi.output/luks}
TIMEOUT=${LUKS_TIMEOUT:-1200}

die() { echo "image/luks-test.sh: $*" >&2; exit 1; }

for tool in qemu-system-x86_64 mkfs.ext4 debugfs go; do
	command -v "$tool" >/dev/null || die "$tool is not installed"
done
[ -d "$ROOT/usr/lib/systemd" ] || die "no image tree at $ROOT (run make image)"
kernel=$(ls "$ROOT"/boot/vmlinuz-* 2>/dev/null | sort -V | tail -n1)
[ -n "$kernel" ] || die "no kernel in $ROOT/boot"
kver=${kernel##*/vmlinuz-}
initrd=$ROOT/boot/initrd.img-$kver
[ -f "$initrd" ] || die "no initrd for $kver in $ROOT/boot"

rm -rf "$WORK"
mkdir -p "$WORK/files"
qemu=
cleanup() {
	if [ -n "$qemu" ]; then
		kill "$qemu" 2>/dev/null || true
		wait "$qemu" 2>/dev/null || true
	fi
}
trap cleanup EXIT

echo "image/luks-test.sh: building the test binary" >&2
(cd "$IMAGE_DIR/.." && CGO_ENABLED=0 go test -c -tags luks -o "$WORK/files/statedisk.test" ./internal/statedisk)

cat >"$WORK/files/berth-luks-test.service" <<'UNIT'
[Unit]
Description=Berth state disk LUKS2 test
After=systemd-modules-load.service local-fs.target

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'modprobe dm_crypt; modprobe dm_integrity; modprobe loop; cd /tmp && { echo BERTH-LUKS-BEGIN; /usr/local/sbin/statedisk.test -test.run "^TestLUKSReal$" -test.count 1 -test.v 2>&1; echo "BERTH-LUKS-EXIT $?"; echo BERTH-LUKS-END; } >/root/berth-luks.out; sync'
ExecStopPost=/bin/systemctl poweroff --no-block
UNIT

disk=$WORK/disk.raw
echo "image/luks-test.sh: making the disk from $ROOT" >&2
truncate -s 3G "$disk"
mkfs.ext4 -q -L berth-root -d "$ROOT" "$disk"
debugfs -w "$disk" -f - >/dev/null 2>"$WORK/debugfs.log" <<EOF
write $WORK/files/statedisk.test /usr/local/sbin/statedisk.test
set_inode_field /usr/local/sbin/statedisk.test mode 0100755
write $WORK/files/berth-luks-test.service /etc/systemd/system/berth-luks-test.service
symlink /etc/systemd/system/multi-user.target.wants/berth-luks-test.service /etc/systemd/system/berth-luks-test.service
symlink /etc/systemd/system/berth-bootstrapper.service /dev/null
symlink /etc/systemd/system/serial-getty@ttyS0.service /dev/null
symlink /etc/systemd/system/getty@tty1.service /dev/null
EOF

console=$WORK/console.log
echo "image/luks-test.sh: booting $kver under QEMU/TCG (console: $console)" >&2
start=$(date +%s)
qemu-system-x86_64 \
	-machine q35,accel=tcg -cpu max -smp 2 -m 2048 \
	-display none -monitor none -no-reboot -nic none \
	-serial "file:$console" \
	-kernel "$kernel" -initrd "$initrd" \
	-append "root=LABEL=berth-root rw console=ttyS0 panic=-1" \
	-drive "file=$disk,if=virtio,format=raw" &
qemu=$!
while kill -0 "$qemu" 2>/dev/null; do
	if (($(date +%s) - start > TIMEOUT)); then
		echo "image/luks-test.sh: guest still running after ${TIMEOUT}s; stopping it" >&2
		break
	fi
	sleep 2
done
cleanup
qemu=
echo "image/luks-test.sh: guest ran $(($(date +%s) - start)) s" >&2
# The guest writes the test's output to a file on its root file system (the serial console is
# shared with systemd's own messages); read it back from the powered-off disk.
report=$(debugfs -R "cat /root/berth-luks.out" "$disk" 2>/dev/null)
[ -n "$report" ] || die "the guest wrote no test output; last console lines:
$(tail -n 40 "$console")"
echo "$report"
printf '%s\n' "$report" | grep -qx 'BERTH-LUKS-EXIT 0' || die "the LUKS2 test failed in the guest (console: $console)"
echo "image/luks-test.sh: LUKS2 state disk test passed under QEMU" >&2
