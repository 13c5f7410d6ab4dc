#!/usr/bin/env bash
# Boots the image's unified kernel image the way a machine does (UEFI firmware: OVMF under QEMU/TCG,
# the UKI as the first boot option on an EFI system partition, swtpm as the TPM with an EK certificate
# from a local CA) and checks, from the host, that the PCRs the node quotes are the ones the build
# computed: `berth verify` against the image's berth.measurements.yaml merged into a policy (swtpm's
# CA as trust root, the lock register PCR 15 fresh). Then a UKI whose kernel command line differs by
# one byte is built from the same tree, its computed PCRs must differ, and the node booted from it must
# be refused by the same policy, naming PCR 4 and PCR 11.
#
# Usage: image/measured-boot-test.sh   (normally `make image-measured-boot-test`, after `make image`)
#
#   IMAGE_ROOT     the tree (its kernel, initrd and root file system)  (default: image/mkosi.output/berth-root)
#   IMAGE_OUT      where berth.efi and berth.measurements.yaml are     (default: image/mkosi.output)
#   BOOT_WORK      scratch dir                                          (default: $IMAGE_OUT/measured)
#   BERTH_CLI      the berth binary                                     (default: bin/berth)
#   BOOT_TIMEOUT   seconds to wait for each guest's attestation         (default: 1200)
#   BOOT_NEGATIVE  0 skips the boot of the changed UKI (its prediction is still compared)
#
# The guest's network is QEMU's user network with restrict=on on a documentation range; only the
# InitServer's port is forwarded, to 127.0.0.1 on the host.
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${IMAGE_OUT:-$IMAGE_DIR/mkosi.output}
ROOT=${IMAGE_ROOT:-$OUT/berth-root}
WORK=${BOOT_WORK:-$OUT/measured}
CLI=${BERTH_CLI:-$IMAGE_DIR/../bin/berth}
TIMEOUT=${BOOT_TIMEOUT:-1200}
NEGATIVE=${BOOT_NEGATIVE:-1}
OVMF_CODE=${OVMF_CODE:-/usr/share/OVMF/OVMF_CODE_4M.fd}
OVMF_VARS=${OVMF_VARS:-/usr/share/OVMF/OVMF_VARS_4M.fd}

die() { echo "image/measured-boot-test.sh: $*" >&2; exit 1; }
say() { echo "image/measured-boot-test.sh: $*" >&2; }

for tool in qemu-system-x86_64 swtpm swtpm_setup swtpm_localca mkfs.ext4 debugfs objcopy python3; do
	command -v "$tool" >/dev/null || die "$tool is not installed (qemu-system-x86, swtpm, swtpm-tools, e2fsprogs, binutils)"
done
[ -f "$OVMF_CODE" ] && [ -f "$OVMF_VARS" ] || die "no OVMF firmware at $OVMF_CODE (Debian package ovmf)"
[ -x "$CLI" ] || die "no berth binary at $CLI (make build)"
[ -f "$OUT/berth.efi" ] && [ -f "$OUT/berth.measurements.yaml" ] || die "no berth.efi and berth.measurements.yaml in $OUT (make image)"
[ -d "$ROOT/usr/lib/systemd" ] || die "no image tree at $ROOT (make image)"
cmdline=$(sed -n 's/^IMAGE_CMDLINE=//p' "$OUT/berth-root.env")
[ -n "$cmdline" ] || die "no IMAGE_CMDLINE in $OUT/berth-root.env"

rm -rf "$WORK"
mkdir -p "$WORK/ca/localca" "$WORK/files"
pids=()
cleanup() {
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	pids=()
}
trap cleanup EXIT

# swtpm's local CA, as internal/attestation/vtpm/vtpmtest sets it up.
cat >"$WORK/ca/swtpm_setup.conf" <<CONF
create_certs_tool = $(command -v swtpm_localca)
create_certs_tool_config = $WORK/ca/swtpm-localca.conf
create_certs_tool_options = $WORK/ca/swtpm-localca.options
CONF
cat >"$WORK/ca/swtpm-localca.conf" <<CONF
statedir = $WORK/ca/localca
signingkey = $WORK/ca/localca/signkey.pem
issuercert = $WORK/ca/localca/issuercert.pem
certserial = $WORK/ca/localca/certserial
CONF
printf -- '--platform-manufacturer Berth\n--platform-version 2.1\n--platform-model measured-boot-test\n' >"$WORK/ca/swtpm-localca.options"

# The root file system, with the test's settings: a static one-node control plane, no state disk.
cat >"$WORK/files/bootstrapper.env" <<'ENV'
BERTH_STATE_DISK_BACKEND=none
BERTH_METADATA_FILE=/etc/berth/metadata.json
ENV
cat >"$WORK/files/metadata.json" <<'JSON'
{"self": {"name": "measured-0", "role": "control-plane", "ips": ["198.51.100.15"]},
 "initSecretHash": "0000000000000000000000000000000000000000000000000000000000000000"}
JSON
# The firmware's event log on the console, so that a mismatch can be traced to its event.
cat >"$WORK/files/berth-eventlog.service" <<'UNIT'
[Unit]
Description=Measured boot test: the firmware event log on the console
After=sysinit.target

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'echo BERTH-EVENTLOG-BEGIN; base64 -w0 /sys/kernel/security/tpm0/binary_bios_measurements; echo; echo BERTH-EVENTLOG-END'
StandardOutput=tty
TTYPath=/dev/ttyS0
UNIT
say "making the root disk from $ROOT"
truncate -s 3G "$WORK/root.raw"
mkfs.ext4 -q -L berth-root -d "$ROOT" "$WORK/root.raw"
debugfs -w "$WORK/root.raw" -f - >/dev/null 2>"$WORK/debugfs.log" <<EOF2
write $WORK/files/bootstrapper.env /etc/berth/bootstrapper.env
write $WORK/files/metadata.json /etc/berth/metadata.json
write $WORK/files/berth-eventlog.service /etc/systemd/system/berth-eventlog.service
symlink /etc/systemd/system/multi-user.target.wants/berth-eventlog.service /etc/systemd/system/berth-eventlog.service
EOF2

# boot NAME UKI POLICY: boots UKI from a fresh EFI system partition with a fresh TPM and runs berth
# verify against it until the node answers; the verdict's exit status is in $WORK/NAME.status.
boot() {
	local name=$1 uki=$2 pol=$3 dir=$WORK/$1
	mkdir -p "$dir/esp/EFI/BOOT" "$dir/tpm"
	cp "$uki" "$dir/esp/EFI/BOOT/BOOTX64.EFI"
	cp "$OVMF_VARS" "$dir/vars.fd"
	cp --reflink=auto "$WORK/root.raw" "$dir/root.raw"
	swtpm_setup --tpm2 --tpmstate "$dir/tpm" --create-ek-cert --config "$WORK/ca/swtpm_setup.conf" --overwrite >"$dir/swtpm_setup.log" 2>&1 ||
		die "swtpm_setup failed: $(tail -n 5 "$dir/swtpm_setup.log")"
	swtpm socket --tpm2 --tpmstate dir="$dir/tpm" --ctrl type=unixio,path="$dir/swtpm.sock" \
		--flags startup-clear --log file="$dir/swtpm.log" &
	pids+=($!)
	for _ in $(seq 50); do [ -S "$dir/swtpm.sock" ] && break; sleep 0.1; done
	[ -S "$dir/swtpm.sock" ] || die "swtpm did not create its socket"
	local port
	port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
	say "$name: booting $(basename "$uki") under QEMU/TCG with OVMF (console: $dir/console.log)"
	local start
	start=$(date +%s)
	qemu-system-x86_64 \
		-machine q35,accel=tcg -cpu max -smp 2 -m 2048 \
		-display none -monitor none -no-reboot -serial "file:$dir/console.log" \
		-drive "if=pflash,format=raw,unit=0,file=$OVMF_CODE,readonly=on" \
		-drive "if=pflash,format=raw,unit=1,file=$dir/vars.fd" \
		-drive "file=fat:ro:$dir/esp,format=raw,if=none,id=esp,readonly=on" -device virtio-blk-pci,drive=esp,bootindex=0 \
		-drive "file=$dir/root.raw,format=raw,if=none,id=root" -device virtio-blk-pci,drive=root \
		-netdev "user,id=n0,restrict=on,net=198.51.100.0/24,hostfwd=tcp:127.0.0.1:$port-:9000" \
		-device virtio-net-pci,netdev=n0,romfile= \
		-chardev "socket,id=chrtpm,path=$dir/swtpm.sock" -tpmdev emulator,id=tpm0,chardev=chrtpm \
		-device tpm-crb,tpmdev=tpm0 &
	local qemu=$!
	pids+=("$qemu")
	local status=1
	while kill -0 "$qemu" 2>/dev/null; do
		if (($(date +%s) - start > TIMEOUT)); then
			say "$name: no attestation after ${TIMEOUT}s"
			break
		fi
		set +e
		"$CLI" verify --endpoint "127.0.0.1:$port" --policy "$pol" --timeout 20s -o json \
			--save-evidence "$dir/evidence" >"$dir/verify.json" 2>"$dir/verify.err"
		status=$?
		set -e
		# 1 is a failure to get a verdict (the node is not up yet); 0 and 3 are verdicts.
		if [ "$status" -ne 1 ]; then
			break
		fi
		sleep 5
	done
	local end
	end=$(date +%s)
	echo "$status" >"$dir/status"
	echo "$((end - start))" >"$dir/seconds"
	cleanup
	if [ "$status" = 1 ]; then
		die "$name: no verdict from the node ($(tail -n 2 "$dir/verify.err")); console:
$(tail -n 30 "$dir/console.log")"
	fi
	say "$name: verdict after $((end - start)) s (exit status $status)"
}

# quoted NAME INDEX: the value the node quoted for a PCR.
quoted() {
	python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(next((m["value"] for m in r.get("measurements") or [] if m["index"]==int(sys.argv[2])), ""))' "$WORK/$1/verify.json" "$2"
}
computed() {
	python3 -c 'import re,sys; t=open(sys.argv[1]).read(); m=re.search(r"^  "+sys.argv[2]+r":\n    expected: ([0-9a-f]+)", t, re.M); print(m.group(1) if m else "")' "$1" "$2"
}

# The cluster policy a user would have: swtpm's CA as trust root, a fresh lock register.
cat >"$WORK/cluster-policy.yaml" <<POL
# measured boot test: swtpm's local CA, a node that is not bootstrapped yet
variant: tpm
trustRoots:
  - file: $WORK/ca/localca/swtpm-localca-rootca-cert.pem
  - file: $WORK/ca/localca/issuercert.pem
measurements:
  15: {expected: "0000000000000000000000000000000000000000000000000000000000000000", source: fresh node}
POL
# The CA files exist after the first swtpm_setup; make them now.
mkdir -p "$WORK/ca-probe"
swtpm_setup --tpm2 --tpmstate "$WORK/ca-probe" --create-ek-cert --config "$WORK/ca/swtpm_setup.conf" --overwrite >/dev/null 2>&1 ||
	die "swtpm_setup failed"
"$CLI" policy merge --policy "$WORK/cluster-policy.yaml" --measurements "$OUT/berth.measurements.yaml" >"$WORK/policy.yaml"
say "merged policy: $WORK/policy.yaml"

fail=0
boot genuine "$OUT/berth.efi" "$WORK/policy.yaml"
for pcr in 4 11; do
	want=$(computed "$OUT/berth.measurements.yaml" "$pcr")
	got=$(quoted genuine "$pcr")
	echo "PCR $pcr computed $want"
	echo "PCR $pcr quoted   $got"
	[ -n "$want" ] && [ "$want" = "$got" ] || { say "FAIL: PCR $pcr quoted differs from computed"; fail=1; }
done
[ "$(cat "$WORK/genuine/status")" = 0 ] || { say "FAIL: berth verify did not accept the genuine node: $(cat "$WORK/genuine/verify.err")"; fail=1; }

# One byte of the command line changed (the last character, or one appended).
changed_cmdline="${cmdline%?}$([ "${cmdline: -1}" = 1 ] && echo 2 || echo 1)"
say "changed command line: '$changed_cmdline'"
BERTH_CLI=$CLI "$IMAGE_DIR/uki.sh" "$ROOT" "$changed_cmdline" "$WORK/changed.efi" "$WORK/changed.measurements.yaml"
for pcr in 4 11; do
	a=$(computed "$OUT/berth.measurements.yaml" "$pcr")
	b=$(computed "$WORK/changed.measurements.yaml" "$pcr")
	echo "PCR $pcr computed for the changed command line $b"
	[ "$a" != "$b" ] || { say "FAIL: PCR $pcr computed the same for a changed command line"; fail=1; }
done
if [ "$NEGATIVE" != 0 ]; then
	boot changed "$WORK/changed.efi" "$WORK/policy.yaml"
	for pcr in 4 11; do
		echo "PCR $pcr quoted by the changed node $(quoted changed "$pcr")"
	done
	if [ "$(cat "$WORK/changed/status")" != 3 ]; then
		say "FAIL: the node booted with the changed command line was not refused (exit status $(cat "$WORK/changed/status"))"
		fail=1
	elif ! grep -q 'index 4' "$WORK/changed/verify.json" || ! grep -q 'index 11' "$WORK/changed/verify.json"; then
		say "FAIL: the refusal does not name PCR 4 and PCR 11: $(cat "$WORK/changed/verify.json")"
		fail=1
	else
		say "the changed node was refused: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["reason"])' "$WORK/changed/verify.json")"
	fi
fi
((fail == 0)) || die "measured boot test failed (work dir $WORK)"
say "measured boot test passed: genuine boot $(cat "$WORK/genuine/seconds") s${NEGATIVE:+, changed boot $(cat "$WORK/changed/seconds" 2>/dev/null || echo -) s}"
