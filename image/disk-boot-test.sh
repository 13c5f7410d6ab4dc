#!/usr/bin/env bash
# Boots the image's disk, berth.qcow2, the way a machine boots it: QEMU/TCG with OVMF as the firmware,
# the disk as its only drive (`-drive file=...`, nothing else prepared), swtpm as the TPM with an EK
# certificate from a local CA. The firmware finds \EFI\BOOT\BOOTX64.EFI on the disk's EFI system
# partition; the initrd opens the dm-verity root with the root hash from the measured command line;
# the bootstrapper's boot stage formats the empty berth-state partition as LUKS2 with dm-integrity
# (real dm-crypt and dm-integrity in the guest kernel) and opens it. Then, from the host, `berth
# verify` against a cluster policy merged with the build's berth.measurements.yaml must accept the
# node, and the quoted PCRs 4, 9, 11 and 12 must equal the computed ones.
#
# Negative (TAMPER=1, the default): the same disk with one byte of /usr/bin/bootstrapper's data changed
# in the root partition. dm-verity must refuse the block (the kernel panics on the corruption, the
# node never serves), and no quote is accepted.
#
# Negative (CHANGED=1, off by default: one more boot): the disk with its UKI replaced by one built from
# the same tree whose command line differs in its last byte. Its computed PCRs 4, 9 and 11 must
# differ from the build's, and the node booted from it must be refused by the same policy (exit
# status 3), the refusal naming those indices.
#
# Usage: image/disk-boot-test.sh   (normally `make test-image-boot`, under flock /tmp/berth-e2e.lock)
#
#   IMAGE_OUT      where berth.qcow2, berth.raw and berth.measurements.yaml are (default: image/mkosi.output)
#   BOOT_WORK      scratch dir                                                 (default: $IMAGE_OUT/disk-boot)
#   BERTH_CLI      the berth binary                                            (default: bin/berth)
#   BOOT_TIMEOUT   seconds to wait for the node's attestation                  (default: 1500)
#   TAMPER         0 skips the boot of the tampered disk
#   GENUINE        0 skips the boot of the genuine disk (to rerun a negative case alone)
#   CHANGED        1 adds the boot of the disk with a changed command line
#
# Without QEMU, OVMF, swtpm or rdsquashfs the test is skipped; under CI=true it fails instead.
# The guest's network is QEMU's user network with restrict=on on a documentation range; only the
# InitServer's port is forwarded, to 127.0.0.1 on the host.
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${IMAGE_OUT:-$IMAGE_DIR/mkosi.output}
WORK=${BOOT_WORK:-$OUT/disk-boot}
CLI=${BERTH_CLI:-$IMAGE_DIR/../bin/berth}
TIMEOUT=${BOOT_TIMEOUT:-1500}
TAMPER=${TAMPER:-1}
CHANGED=${CHANGED:-0}
GENUINE=${GENUINE:-1}
REBOOT=${REBOOT:-1}
OVMF_CODE=${OVMF_CODE:-/usr/share/OVMF/OVMF_CODE_4M.fd}
OVMF_VARS=${OVMF_VARS:-/usr/share/OVMF/OVMF_VARS_4M.fd}

die() { echo "image/disk-boot-test.sh: $*" >&2; exit 1; }
say() { echo "image/disk-boot-test.sh: $*" >&2; }
missing() {
	if [ "${CI:-}" = true ]; then
		die "prerequisite missing under CI=true: $*"
	fi
	say "SKIP: $* (scripts/install-deps.sh installs it)"
	exit 0
}

for tool in qemu-system-x86_64 qemu-img swtpm swtpm_setup swtpm_localca rdsquashfs sfdisk mcopy objcopy python3; do
	command -v "$tool" >/dev/null || missing "$tool is not installed"
done
[ -f "$OVMF_CODE" ] && [ -f "$OVMF_VARS" ] || missing "no OVMF firmware at $OVMF_CODE (Debian package ovmf)"
[ -x "$CLI" ] || die "no berth binary at $CLI (make build)"
for f in berth.qcow2 berth.raw berth.measurements.yaml berth-root.squashfs; do
	[ -f "$OUT/$f" ] || die "no $OUT/$f (make image)"
done

test_start=$(date +%s)
rm -rf "$WORK"
mkdir -p "$WORK/ca/localca"
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
printf -- '--platform-manufacturer Berth\n--platform-version 2.1\n--platform-model disk-boot-test\n' >"$WORK/ca/swtpm-localca.options"
mkdir -p "$WORK/ca-probe"
swtpm_setup --tpm2 --tpmstate "$WORK/ca-probe" --create-ek-cert --config "$WORK/ca/swtpm_setup.conf" --overwrite >/dev/null 2>&1 ||
	die "swtpm_setup failed"

# The cluster policy a user would have: swtpm's CA as trust root, a fresh lock register; merged with
# the build's measurements (PCRs 4, 9, 11, 12).
cat >"$WORK/cluster-policy.yaml" <<POL
# disk boot test: swtpm's local CA, a node that is not bootstrapped yet
variant: tpm
trustRoots:
  - file: $WORK/ca/localca/swtpm-localca-rootca-cert.pem
  - file: $WORK/ca/localca/issuercert.pem
measurements:
  15: {expected: "0000000000000000000000000000000000000000000000000000000000000000", source: fresh node}
POL
"$CLI" policy merge --policy "$WORK/cluster-policy.yaml" --measurements "$OUT/berth.measurements.yaml" >"$WORK/policy.yaml"

# boot NAME DISK: boots a copy-on-write overlay of DISK (qcow2) as the VM's only drive with a fresh
# TPM and runs berth verify against it until it answers, the VM stops, or the time is up. The
# verdict's exit status (or "none") is in $WORK/NAME/status, the seconds in $WORK/NAME/seconds.
#
# boot NAME DISK FROM: a reboot of the machine of the earlier boot FROM: DISK (that machine's disk,
# used as it is) with FROM's TPM state and firmware variables.
# GUEST_PORT (default 9000) is the guest port berth verify asks; POWERDOWN=1 shuts the guest down
# through an ACPI power button press after the verdict (QMP system_powerdown) instead of killing it.
diskformat() {
	qemu-img info --output=json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["format"])'
}
boot() {
	local name=$1 disk=$2 from=${3:-} dir=$WORK/$1
	local tpm=$dir/tpm vars=$dir/vars.fd drive=$dir/node.qcow2
	mkdir -p "$dir"
	if [ -n "$from" ]; then
		tpm=$WORK/$from/tpm vars=$WORK/$from/vars.fd drive=$disk
	else
		mkdir -p "$tpm"
		cp "$OVMF_VARS" "$vars"
		qemu-img create -q -f qcow2 -b "$disk" -F "$(diskformat "$disk")" "$drive"
		swtpm_setup --tpm2 --tpmstate "$tpm" --create-ek-cert --config "$WORK/ca/swtpm_setup.conf" --overwrite >"$dir/swtpm_setup.log" 2>&1 ||
			die "swtpm_setup failed: $(tail -n 5 "$dir/swtpm_setup.log")"
	fi
	swtpm socket --tpm2 --tpmstate dir="$tpm" --ctrl type=unixio,path="$dir/swtpm.sock" \
		--flags startup-clear --log file="$dir/swtpm.log" &
	pids+=($!)
	for _ in $(seq 50); do [ -S "$dir/swtpm.sock" ] && break; sleep 0.1; done
	[ -S "$dir/swtpm.sock" ] || die "swtpm did not create its socket"
	local port
	port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
	say "$name: booting $(basename "$disk") under QEMU/TCG with OVMF (console: $dir/console.log)"
	local start
	start=$(date +%s)
	# -nodefaults: no empty CD-ROM drive ahead of the disk in the firmware's boot order. A failed boot
	# attempt before the UKI adds "Returning from" and "Calling EFI Application" events to PCR 4.
	qemu-system-x86_64 -nodefaults \
		-machine q35,accel=tcg -cpu max -smp 2 -m 2048 \
		-display none -monitor none -no-reboot -serial "file:$dir/console.log" \
		-qmp "unix:$dir/qmp.sock,server=on,wait=off" \
		-drive "if=pflash,format=raw,unit=0,file=$OVMF_CODE,readonly=on" \
		-drive "if=pflash,format=raw,unit=1,file=$vars" \
		-drive "file=$drive,format=$(diskformat "$drive")" \
		-netdev "user,id=n0,restrict=on,net=198.51.100.0/24,hostfwd=tcp:127.0.0.1:$port-:${GUEST_PORT:-9000}" \
		-device virtio-net-pci,netdev=n0,romfile= \
		-chardev "socket,id=chrtpm,path=$dir/swtpm.sock" -tpmdev emulator,id=tpm0,chardev=chrtpm \
		-device tpm-crb,tpmdev=tpm0 &
	local qemu=$!
	pids+=("$qemu")
	local status=none
	while kill -0 "$qemu" 2>/dev/null; do
		if (($(date +%s) - start > TIMEOUT)); then
			say "$name: no attestation after ${TIMEOUT}s"
			break
		fi
		set +e
		"$CLI" verify --endpoint "127.0.0.1:$port" --policy "$WORK/policy.yaml" --timeout 60s -o json \
			--save-evidence "$dir/evidence" >"$dir/verify.json" 2>"$dir/verify.err"
		local rc=$?
		set -e
		# 1 is a failure to get a verdict (the node is not up yet); 0 and 3 are verdicts.
		if [ "$rc" -ne 1 ]; then
			status=$rc
			break
		fi
		sleep 5
	done
	local end
	end=$(date +%s)
	echo "$status" >"$dir/status"
	echo "$((end - start))" >"$dir/seconds"
	if [ "${POWERDOWN:-0}" = 1 ] && kill -0 "$qemu" 2>/dev/null; then
		powerdown "$dir/qmp.sock"
		for _ in $(seq 180); do kill -0 "$qemu" 2>/dev/null || break; sleep 1; done
		if kill -0 "$qemu" 2>/dev/null; then
			say "$name: the guest did not power off within 180 s of the power button; stopping QEMU"
		else
			say "$name: the guest powered off $(($(date +%s) - end)) s after the power button"
		fi
	fi
	cleanup
	say "$name: verdict $status after $((end - start)) s"
}

# powerdown QMPSOCK: presses the guest's ACPI power button.
powerdown() {
	python3 - "$1" <<'PY' || say "QMP system_powerdown failed"
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
f = s.makefile("rw")
f.readline()
for cmd in ("qmp_capabilities", "system_powerdown"):
    f.write(json.dumps({"execute": cmd}) + "\n")
    f.flush()
    while "return" not in json.loads(f.readline()):
        pass
PY
}

# console NAME FIELD: the value of the zap field FIELD in the first "state disk boot record" line of
# NAME's console.
bootrecord() {
	python3 -c 'import re,sys; m=re.search(r"state disk boot record.*?\""+sys.argv[2]+r"\": *\"([^\"]*)\"", open(sys.argv[1], errors="replace").read()); print(m.group(1) if m else "")' "$WORK/$1/console.log" "$2"
}

# holds FILE MARKER: whether FILE's bytes contain MARKER as text, as hex without dashes (the
# journal's form) or as its 16 raw bytes.
holds() {
	python3 - "$1" "$2" <<'PY'
import mmap, sys
path, marker = sys.argv[1], sys.argv[2]
forms = [marker.encode(), marker.replace("-", "").encode()]
try:
    forms.append(bytes.fromhex(marker.replace("-", "")))
except ValueError:
    pass
with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    sys.exit(0 if any(m.find(x) >= 0 for x in forms) else 1)
PY
}

quoted() {
	python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(next((m["value"] for m in r.get("measurements") or [] if m["index"]==int(sys.argv[2])), ""))' "$WORK/$1/verify.json" "$2"
}
computed() {
	python3 -c 'import re,sys; t=open(sys.argv[1]).read(); m=re.search(r"^  "+sys.argv[2]+r":\n    expected: ([0-9a-f]+)", t, re.M); print(m.group(1) if m else "")' "${2:-$OUT/berth.measurements.yaml}" "$1"
}
# partstart NAME DISK: the byte offset of the partition labelled NAME.
partstart() {
	sfdisk -J "$2" | python3 -c 'import json,sys; t=json.load(sys.stdin)["partitiontable"]; print(next(p["start"] for p in t["partitions"] if p.get("name")==sys.argv[1])*t.get("sectorsize",512))' "$1"
}

# changeduki: $WORK/changed.efi, the build's UKI with its command line's last byte changed, and its
# computed measurements $WORK/changed.measurements.yaml.
changeduki() {
	[ -f "$WORK/changed.efi" ] && return 0
	cmdline=$(sed -n 's/^IMAGE_CMDLINE=//p' "$OUT/berth-root.env")
	[ -n "$cmdline" ] || die "no IMAGE_CMDLINE in $OUT/berth-root.env"
	changed_cmdline="${cmdline%?}$([ "${cmdline: -1}" = 1 ] && echo 2 || echo 1)"
	say "changed command line: '$changed_cmdline'"
	BERTH_CLI=$CLI "$IMAGE_DIR/uki.sh" "$OUT/berth-root" "$changed_cmdline" "$WORK/changed.efi" "$WORK/changed.measurements.yaml"
}
# withuki RAW EFI: replaces the UKI on RAW's ESP with EFI.
withuki() {
	MTOOLS_SKIP_CHECK=1 mcopy -o -i "$1@@$(partstart berth-esp "$1")" "$2" ::/EFI/BOOT/BOOTX64.EFI
}

# droppedcheck NAME: the refusal of NAME's evidence depends on PCRs 4, 9 and 11: with any one of them
# dropped from the policy it is still refused (by the other two), with all three dropped it is
# accepted (berth policy check on the evidence berth verify saved).
droppedcheck() {
	local ev=$WORK/$1/evidence rc
	for drop in 4 9 11 "4 9 11"; do
		python3 - "$WORK/policy.yaml" "$WORK/$1/policy-without-${drop// /-}.yaml" $drop <<'PY'
# Drops the entries by their lines, so that every other value keeps its text (a YAML round trip
# would read an unquoted all-zero digest as the number 0).
import re, sys
src, dst, drop = sys.argv[1], sys.argv[2], {int(x) for x in sys.argv[3:]}
out, section, skipping = [], False, False
for line in open(src):
    if not line.startswith(" ") and line.strip():
        section, skipping = line.startswith("measurements:"), False
    elif section:
        m = re.match(r"  (\d+):", line)
        if m:
            skipping = int(m.group(1)) in drop
    if not skipping:
        out.append(line)
open(dst, "w").writelines(out)
PY
		set +e
		"$CLI" policy check --policy "$WORK/$1/policy-without-${drop// /-}.yaml" --evidence "$ev" -o json >"$WORK/$1/check-without-${drop// /-}.json" 2>/dev/null
		rc=$?
		set -e
		echo "policy without PCR $drop: berth policy check exit status $rc"
		if [ "$drop" = "4 9 11" ]; then
			[ "$rc" = 0 ] || { say "FAIL: with PCRs 4, 9 and 11 dropped the evidence is still refused (status $rc): the negative does not rest on them"; fail=1; }
		else
			[ "$rc" = 3 ] || { say "FAIL: with PCR $drop dropped the evidence is not refused (status $rc)"; fail=1; }
		fi
	done
}

fail=0
if [ "$GENUINE" = 0 ]; then
	say "genuine boot skipped (GENUINE=0)"
else
POWERDOWN=$REBOOT boot genuine "$OUT/berth.qcow2"
if [ "$(cat "$WORK/genuine/status")" != 0 ]; then
	say "FAIL: berth verify did not accept the genuine node (status $(cat "$WORK/genuine/status")): $(cat "$WORK/genuine/verify.err" "$WORK/genuine/verify.json" 2>/dev/null | tail -n 5)"
	say "console: $(tail -n 40 "$WORK/genuine/console.log")"
	fail=1
else
	for pcr in 4 9 11 12; do
		want=$(computed "$pcr")
		got=$(quoted genuine "$pcr")
		echo "PCR $pcr computed $want"
		echo "PCR $pcr quoted   $got"
		[ -n "$want" ] && [ "$want" = "$got" ] || { say "FAIL: PCR $pcr quoted differs from computed"; fail=1; }
	done
fi
# The boot phase register (PCR 13 in the image): marked once the state disk was open, so the node
# quotes the phase's value, one of the two the computed policy accepts.
phasepcr=$(sed -n 's/^BERTH_PHASE_PCR=//p' "$OUT/berth-root/usr/lib/berth/bootstrapper.env" | tail -n1)
if [ -n "$phasepcr" ] && [ "$phasepcr" != 0 ]; then
	got=$(quoted genuine "$phasepcr")
	echo "PCR $phasepcr (boot phase) quoted $got"
	if [ "$got" = "$(printf '%064d' 0)" ] || [ -z "$got" ] || ! grep -q 'boot phase marked' "$WORK/genuine/console.log"; then
		say "FAIL: the genuine node did not mark the state disk phase in PCR $phasepcr"
		fail=1
	fi
fi
# The boot stage formatted and opened the LUKS2 state disk (its log reaches the console through
# journald), on the disk's berth-state partition.
if grep -q 'state disk formatted with a random key' "$WORK/genuine/console.log" && grep -q '"source": *"fresh"\|state disk open' "$WORK/genuine/console.log"; then
	say "the boot stage formatted and opened the LUKS2 state disk: $(grep -o '"msg":"state disk open"[^}]*' "$WORK/genuine/console.log" | head -n1)"
else
	say "FAIL: no sign in the console that the boot stage formatted and opened the state disk"
	fail=1
fi
fi

# Reboot (REBOOT=1, the default): the same machine (disk, TPM state, firmware variables) boots again.
# The first boot sealed its fresh disk key to the TPM (BERTH_SEAL_FRESH_DISK) and recorded its boot
# ID on the disk; this boot must unseal the key unattended and read that boot ID back. The marker
# is the first boot's random boot ID, which the host knows only from the console.
if [ "$GENUINE" != 0 ] && [ "$REBOOT" = 1 ]; then
	marker=$(bootrecord genuine bootID)
	if [ -z "$marker" ]; then
		say "FAIL: the first boot recorded no boot ID on the state disk"
		fail=1
	elif ! grep -q 'disk key sealed to this TPM' "$WORK/genuine/console.log"; then
		say "FAIL: the first boot did not seal its disk key to the TPM"
		fail=1
	else
		say "first boot: disk key sealed, boot ID $marker recorded on the state disk"
		boot reboot "$WORK/genuine/node.qcow2" genuine
		prev=$(bootrecord reboot previousBootID)
		if [ "$(cat "$WORK/reboot/status")" != 0 ]; then
			say "FAIL: the rebooted node was not accepted (status $(cat "$WORK/reboot/status")): $(tail -n 5 "$WORK/reboot/verify.err" "$WORK/reboot/verify.json" 2>/dev/null)"
			fail=1
		fi
		if grep -q 'state disk opened with the key sealed to this TPM' "$WORK/reboot/console.log" &&
			! grep -q 'state disk formatted' "$WORK/reboot/console.log"; then
			say "reboot: the state disk opened unattended with the sealed key: $(grep -o 'state disk opened with the key sealed[^}]*' "$WORK/reboot/console.log" | head -n1)"
		else
			say "FAIL: the rebooted node did not open its state disk with the sealed key"
			fail=1
		fi
		if [ "$prev" = "$marker" ]; then
			say "reboot: the first boot's marker $marker read back from the state disk"
		else
			say "FAIL: the rebooted node read '$prev' from the state disk, want the first boot's '$marker'"
			fail=1
		fi
		# The host's copy of the disk: the qcow2 overlay and a flat raw copy of it must not hold the
		# marker. Control: the same search finds it in the console log and in a copy of the raw disk
		# with the marker written into the state partition.
		qemu-img convert -O raw "$WORK/genuine/node.qcow2" "$WORK/flat.raw"
		statestart=$(partstart berth-state "$WORK/flat.raw")
		for f in "$WORK/genuine/node.qcow2" "$WORK/flat.raw"; do
			if holds "$f" "$marker"; then
				say "FAIL: the host's disk file $(basename "$f") holds the marker in plaintext"
				fail=1
			else
				say "the host's disk file $(basename "$f") ($(du -m --apparent-size "$f" | cut -f1) MiB) does not hold the marker"
			fi
		done
		cp --reflink=auto "$WORK/flat.raw" "$WORK/control.raw"
		printf '%s' "$marker" | dd of="$WORK/control.raw" bs=1 seek=$((statestart + 4096 * 1000)) conv=notrunc status=none
		if holds "$WORK/control.raw" "$marker" && holds "$WORK/genuine/console.log" "$marker"; then
			say "control: the search finds the marker in the console log and in the disk copy with it written into the state partition"
		else
			say "FAIL: the control search did not find the marker: the search cannot fail"
			fail=1
		fi
		rm -f "$WORK/control.raw"

		# The same machine booted with a changed command line: the TPM must refuse the sealed key.
		# The disk was never bound to a cluster, so the node then wipes it and comes up fresh (a
		# bound disk would wait for a rejoin ticket or berth recover instead), and the policy must
		# refuse that node.
		changeduki
		cp --reflink=auto "$WORK/flat.raw" "$WORK/changed-sealed.raw"
		withuki "$WORK/changed-sealed.raw" "$WORK/changed.efi"
		boot changed-sealed "$WORK/changed-sealed.raw" genuine
		refusal=$(grep -o 'the TPM refused the sealed disk key[^}]*' "$WORK/changed-sealed/console.log" | head -n1 || true)
		if [ -n "$refusal" ] && ! grep -q 'state disk opened with the key sealed' "$WORK/changed-sealed/console.log"; then
			say "changed command line: the TPM refused the sealed key: $refusal"
		else
			say "FAIL: the node booted with a changed command line did not show the TPM's refusal of the sealed key"
			fail=1
		fi
		if grep -q "\"previousBootID\": *\"$marker\"\|$(bootrecord reboot bootID)" "$WORK/changed-sealed/console.log"; then
			say "FAIL: the node booted with a changed command line read the earlier boots' record from the disk"
			fail=1
		fi
		if [ "$(cat "$WORK/changed-sealed/status")" != 3 ]; then
			say "FAIL: the node booted with a changed command line was not refused (status $(cat "$WORK/changed-sealed/status"))"
			fail=1
		else
			say "changed command line: refused: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["reason"])' "$WORK/changed-sealed/verify.json")"
			droppedcheck changed-sealed
		fi
	fi
fi

if [ "$TAMPER" != 0 ]; then
	# One byte inside the first data block of /usr/bin/bootstrapper in the root partition.
	blocks=$(rdsquashfs --stat /usr/bin/bootstrapper "$OUT/berth-root.squashfs" | sed -n 's/^Blocks start:[[:space:]]*//p')
	[ -n "$blocks" ] || die "rdsquashfs gave no data offset for /usr/bin/bootstrapper: $(rdsquashfs --stat /usr/bin/bootstrapper "$OUT/berth-root.squashfs" | head -n 20)"
	rootstart=$(partstart berth-root "$OUT/berth.raw")
	off=$((rootstart + blocks + 100))
	cp --reflink=auto "$OUT/berth.raw" "$WORK/tampered.raw"
	b=$(od -An -tu1 -j "$off" -N1 "$WORK/tampered.raw" | tr -d ' ')
	printf "$(printf '\\x%02x' $((b ^ 1)))" | dd of="$WORK/tampered.raw" bs=1 seek="$off" conv=notrunc status=none
	ndiff=$( (cmp -l "$OUT/berth.raw" "$WORK/tampered.raw" || true) | wc -l)
	[ "$ndiff" = 1 ] || die "the tampered disk differs in $ndiff bytes, want 1"
	say "tampered disk: byte $off (bootstrapper data at $blocks in the root partition) flipped"
	boot tampered "$WORK/tampered.raw"
	st=$(cat "$WORK/tampered/status")
	if [ "$st" = 0 ]; then
		say "FAIL: the node booted from the tampered disk was accepted"
		fail=1
	elif grep -qi 'verity.*corrupt\|data block.*is corrupted' "$WORK/tampered/console.log"; then
		say "the tampered disk was refused by dm-verity: $(grep -i -m1 'corrupt' "$WORK/tampered/console.log" | tr -d '\r')"
	else
		say "FAIL: the tampered node did not attest, but the console has no dm-verity corruption message"
		fail=1
	fi
	grep -q 'state disk formatted\|state disk open' "$WORK/tampered/console.log" &&
		{ say "FAIL: the tampered node reached the boot stage"; fail=1; }
fi

if [ "$CHANGED" = 1 ]; then
	changeduki
	for pcr in 4 9 11 12; do
		a=$(computed "$pcr") b=$(computed "$pcr" "$WORK/changed.measurements.yaml")
		echo "PCR $pcr computed for the changed command line $b"
		if [ "$pcr" = 12 ]; then
			[ "$a" = "$b" ] || { say "FAIL: PCR 12 computed differently for a changed .cmdline"; fail=1; }
		else
			[ "$a" != "$b" ] || { say "FAIL: PCR $pcr computed the same for a changed command line"; fail=1; }
		fi
	done
	cp --reflink=auto "$OUT/berth.raw" "$WORK/changed.raw"
	withuki "$WORK/changed.raw" "$WORK/changed.efi"
	boot changed "$WORK/changed.raw"
	for pcr in 4 9 11 12; do
		echo "PCR $pcr quoted by the changed node $(quoted changed "$pcr")"
	done
	if [ "$(cat "$WORK/changed/status")" != 3 ]; then
		say "FAIL: the node booted with the changed command line was not refused (exit status $(cat "$WORK/changed/status"))"
		fail=1
	elif ! grep -q 'index 4' "$WORK/changed/verify.json" || ! grep -q 'index 9' "$WORK/changed/verify.json" || ! grep -q 'index 11' "$WORK/changed/verify.json"; then
		say "FAIL: the refusal does not name PCRs 4, 9 and 11: $(cat "$WORK/changed/verify.json")"
		fail=1
	else
		say "the changed node was refused: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["reason"])' "$WORK/changed/verify.json")"
		droppedcheck changed
	fi
fi

((fail == 0)) || die "disk boot test failed (work dir $WORK)"
say "disk boot test passed in $(($(date +%s) - test_start)) s: genuine boot to accepted quote $(cat "$WORK/genuine/seconds" 2>/dev/null || echo -) s, reboot to accepted quote $(cat "$WORK/reboot/seconds" 2>/dev/null || echo -) s, changed command line on the sealed disk to refusal $(cat "$WORK/changed-sealed/seconds" 2>/dev/null || echo -) s, tampered boot to its end $(cat "$WORK/tampered/seconds" 2>/dev/null || echo -) s, changed boot $(cat "$WORK/changed/seconds" 2>/dev/null || echo -) s"
