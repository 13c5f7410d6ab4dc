#!/usr/bin/env bash
# Boots the built image tree under QEMU with software emulation (TCG, no KVM needed) and swtpm as
# its TPM, lets systemd start the node's units for real, and checks what they did from a report the
# guest prints on its serial console before powering off.
#
# Usage: image/boot-test.sh            (normally through `make image-boot-test`, after `make image`)
#
#   IMAGE_ROOT     the tree to boot                  (default: image/mkosi.output/berth-root)
#   BOOT_WORK      scratch dir: disk, TPM, console   (default: image/mkosi.output/boot)
#   BOOT_TIMEOUT   seconds to wait for the guest     (default: 900)
#
# The disk is an ext4 file system made from the tree (mkfs.ext4 -d, no mount needed), booted with
# the tree's own kernel and initrd. Test-only files are written into the disk with debugfs, never
# into the tree: /etc/berth/bootstrapper.env and metadata.json (a static, one-node control plane;
# attestation insecure-none, the only variant the daemon serves so far) and a report unit.
# The guest's network is QEMU's user network with restrict=on on a documentation range: the guest
# reaches nothing outside QEMU.
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=${IMAGE_ROOT:-$IMAGE_DIR/mkosi.output/berth-root}
WORK=${BOOT_WORK:-$IMAGE_DIR/mkosi.output/boot}
TIMEOUT=${BOOT_TIMEOUT:-900}

die() { echo "image/boot-test.sh: $*" >&2; exit 1; }

for tool in qemu-system-x86_64 swtpm mkfs.ext4 debugfs; do
	command -v "$tool" >/dev/null || die "$tool is not installed (qemu-system-x86, swtpm, e2fsprogs)"
done
[ -d "$ROOT/usr/lib/systemd" ] || die "no image tree at $ROOT (run make image)"
kernel=$(ls "$ROOT"/boot/vmlinuz-* 2>/dev/null | sort -V | tail -n1)
[ -n "$kernel" ] || die "no kernel in $ROOT/boot"
kver=${kernel##*/vmlinuz-}
initrd=$ROOT/boot/initrd.img-$kver
[ -f "$initrd" ] || die "no initrd for $kver in $ROOT/boot"

rm -rf "$WORK"
mkdir -p "$WORK/tpm" "$WORK/files"

pids=()
cleanup() {
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
}
trap cleanup EXIT

# Test-only files.
cat >"$WORK/files/bootstrapper.env" <<'EOF'
# boot test: the daemon serves only insecure-none so far; static metadata below.
BERTH_ATTESTATION=insecure-none
BERTH_METADATA_FILE=/etc/berth/metadata.json
EOF
cat >"$WORK/files/metadata.json" <<'EOF'
{"self": {"name": "boot-test-0", "role": "control-plane", "ips": ["198.51.100.15"]},
 "initSecretHash": "0000000000000000000000000000000000000000000000000000000000000000"}
EOF
cat >"$WORK/files/berth-boot-report.service" <<'EOF'
[Unit]
Description=Berth boot test report
After=berth-bootstrapper.service containerd.service systemd-networkd-wait-online.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/berth-boot-report
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS0
EOF
cat >"$WORK/files/berth-boot-report" <<'EOF'
#!/bin/sh
# Prints what the boot test checks, one "CHECK name value" line each, then powers off.
check() { printf 'CHECK %s %s\n' "$1" "$(echo $2)"; }
echo BERTH-BOOT-REPORT-BEGIN
# give a restarting bootstrapper a moment to settle
sleep 5
for u in berth-bootstrapper containerd berth-cmdline-env systemd-networkd kubelet; do
	check "active:$u" "$(systemctl is-active $u.service)"
done
check enabled:kubelet "$(systemctl is-enabled kubelet.service)"
check bootstrapper-type "$(systemctl show -P Type berth-bootstrapper.service)"
check bootstrapper-restarts "$(systemctl show -P NRestarts berth-bootstrapper.service)"
check cmdline-env "$(grep -v '^#' /run/berth/cmdline.env 2>&1)"
check ip_forward "$(cat /proc/sys/net/ipv4/ip_forward)"
check bridge-nf-call-iptables "$(cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>&1)"
check modules "$(grep -oE '^(overlay|br_netfilter) ' /proc/modules | sort)"
check tpmrm0 "$(test -c /dev/tpmrm0 && echo present || echo missing)"
check listen-9000 "$(ss -Hltn 'sport = :9000' | wc -l)"
check containerd-serving "$(ctr --address /run/containerd/containerd.sock version >/dev/null 2>&1 && echo yes || echo no)"
check failed-units "$(systemctl list-units --failed --plain --no-legend | awk '{print $1}')"
echo "--- systemd-analyze security berth-bootstrapper.service"
systemd-analyze security --no-pager berth-bootstrapper.service 2>&1 | tail -n 3
echo "--- journal of berth-bootstrapper.service"
journalctl -b --no-pager -o cat -u berth-bootstrapper.service | tail -n 30
echo "--- boot time"
systemd-analyze time 2>&1 | head -n 2
echo BERTH-BOOT-REPORT-END
systemctl poweroff --no-block
EOF
chmod 0755 "$WORK/files/berth-boot-report"

echo "image/boot-test.sh: making the disk from $ROOT" >&2
disk=$WORK/disk.raw
truncate -s 3G "$disk"
mkfs.ext4 -q -L berth-root -d "$ROOT" "$disk"
debugfs -w "$disk" -f - >/dev/null 2>"$WORK/debugfs.log" <<EOF
write $WORK/files/bootstrapper.env /etc/berth/bootstrapper.env
write $WORK/files/metadata.json /etc/berth/metadata.json
write $WORK/files/berth-boot-report.service /etc/systemd/system/berth-boot-report.service
write $WORK/files/berth-boot-report /usr/local/sbin/berth-boot-report
symlink /etc/systemd/system/multi-user.target.wants/berth-boot-report.service /etc/systemd/system/berth-boot-report.service
EOF

swtpm socket --tpm2 --tpmstate dir="$WORK/tpm" --ctrl type=unixio,path="$WORK/swtpm.sock" \
	--flags startup-clear --log file="$WORK/swtpm.log" &
pids+=($!)
for _ in $(seq 50); do [ -S "$WORK/swtpm.sock" ] && break; sleep 0.1; done
[ -S "$WORK/swtpm.sock" ] || die "swtpm did not create its socket"

console=$WORK/console.log
echo "image/boot-test.sh: booting $kver under QEMU/TCG (console: $console)" >&2
start=$(date +%s)
qemu-system-x86_64 \
	-machine q35,accel=tcg -cpu max -smp 2 -m 2048 \
	-display none -monitor none -no-reboot \
	-serial "file:$console" \
	-kernel "$kernel" -initrd "$initrd" \
	-append "root=LABEL=berth-root rw console=ttyS0 panic=-1 berth.metadata=static berth.tpm=/dev/tpmrm0" \
	-drive "file=$disk,if=virtio,format=raw" \
	-nic "user,restrict=on,net=198.51.100.0/24,model=virtio-net-pci" \
	-chardev "socket,id=chrtpm,path=$WORK/swtpm.sock" -tpmdev emulator,id=tpm0,chardev=chrtpm \
	-device tpm-crb,tpmdev=tpm0 &
qemu=$!
pids+=("$qemu")
while kill -0 "$qemu" 2>/dev/null; do
	if (($(date +%s) - start > TIMEOUT)); then
		echo "image/boot-test.sh: guest still running after ${TIMEOUT}s; stopping it" >&2
		break
	fi
	sleep 2
done
cleanup
pids=()
end=$(date +%s)
echo "image/boot-test.sh: guest ran $((end - start)) s" >&2

report=$(sed -n '/BERTH-BOOT-REPORT-BEGIN/,/BERTH-BOOT-REPORT-END/p' "$console" | tr -d '\r')
[ -n "$report" ] || die "no report on the console; last lines:
$(tail -n 40 "$console")"
echo "$report"

fail=0
expect() {
	local got
	got=$(printf '%s\n' "$report" | sed -n "s/^CHECK $1 //p")
	if [ "$got" != "$2" ]; then
		echo "FAIL $1: got '$got', want '$2'" >&2
		fail=1
	fi
}
expect active:berth-bootstrapper active
expect active:containerd active
expect active:berth-cmdline-env active
expect active:systemd-networkd active
expect bootstrapper-type notify
expect bootstrapper-restarts 0
expect cmdline-env "BERTH_METADATA=static BERTH_TPM=/dev/tpmrm0"
expect ip_forward 1
expect bridge-nf-call-iptables 1
expect modules "br_netfilter overlay"
expect tpmrm0 present
expect listen-9000 1
expect containerd-serving yes
expect enabled:kubelet disabled
expect failed-units ""
if ((fail)); then
	die "boot test failed (console: $console)"
fi
echo "image/boot-test.sh: boot test passed in $((end - start)) s" >&2
