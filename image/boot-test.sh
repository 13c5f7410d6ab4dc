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
# the image's own attestation variant, tpm by default, against swtpm), a report unit, and a
# sandbox probe: a copy of berth-bootstrapper.service with all its sandboxing whose ExecStart runs
# the kubeadm init phases that need no images or API server (preflight without the image check,
# certs, kubeconfig, etcd and control-plane manifests, kubelet-start) and then
# `systemctl enable --now kubelet.service` as the daemon does, so kubeadm's writes and the kubelet
# drop-in are exercised under the real unit.
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
# kubeadm's phases run at the Kubernetes version of the image's own kubeadm.
K8S_VERSION=$("$ROOT/usr/bin/kubeadm" version -o short) || die "the image's kubeadm does not run"
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
# boot test: static metadata below; the attestation variant is the image's. The guest's one disk
# has no berth-state partition: the state disk (LUKS2) is exercised by make test-luks instead.
BERTH_STATE_DISK_BACKEND=none
BERTH_METADATA_FILE=/etc/berth/metadata.json
EOF
cat >"$WORK/files/metadata.json" <<'EOF'
{"self": {"name": "boot-test-0", "role": "control-plane", "ips": ["198.51.100.15"]},
 "initSecretHash": "0000000000000000000000000000000000000000000000000000000000000000"}
EOF
cat >"$WORK/files/probe-kubeadm.yaml" <<EOF
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: 198.51.100.15
  bindPort: 6443
nodeRegistration:
  name: boot-test-0
  criSocket: unix:///run/containerd/containerd.sock
  # No images here: preflight reports them missing (ignored below) instead of trying to pull.
  imagePullPolicy: Never
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: $K8S_VERSION
---
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: systemd
EOF
cat >"$WORK/files/berth-sandbox-probe" <<'EOF'
#!/bin/sh
# Runs inside a copy of berth-bootstrapper.service's sandbox.
set -eu
mkdir -p /run/berth-probe
systemctl is-enabled kubelet.service >/run/berth-probe/kubelet-before || true
# TPM2_GetRandom(8) straight to the resource manager: the response code (bytes 7-10) is 0 when the
# sandbox lets the unit reach the TPM.
exec 3<>/dev/tpmrm0
printf '\200\001\000\000\000\014\000\000\001\173\000\010' >&3
dd bs=64 count=1 <&3 2>/dev/null | od -An -tx1 -j6 -N4 | tr -d ' \n' >/run/berth-probe/tpm-rc
exec 3>&-
cfg=/etc/berth/probe-kubeadm.yaml
echo "probe: kubeadm init phase preflight"
kubeadm init phase preflight --config "$cfg" --ignore-preflight-errors=ImagePull
for phase in "certs all" "kubeconfig all" "etcd local" "control-plane all" "kubelet-start"; do
	echo "probe: kubeadm init phase $phase"
	# shellcheck disable=SC2086 # the phase is two words
	kubeadm init phase $phase --config "$cfg"
done
systemctl enable --now kubelet.service
echo "probe: done"
EOF
sed -e 's/^Description=.*/Description=Berth boot test: kubeadm under the bootstrapper sandbox/' \
	-e 's/^Type=notify$/Type=oneshot/' -e '/^NotifyAccess=/d' -e '/^Restart/d' -e '/^RemainAfterExit=/d' \
	-e 's|^ExecStart=/usr/bin/bootstrapper$|ExecStart=/usr/local/sbin/berth-sandbox-probe|' \
	-e 's/^TimeoutStartSec=.*/TimeoutStartSec=20min/' \
	"$ROOT/usr/lib/systemd/system/berth-bootstrapper.service" >"$WORK/files/berth-sandbox-probe.service"
grep -q '^ExecStart=/usr/local/sbin/berth-sandbox-probe$' "$WORK/files/berth-sandbox-probe.service" ||
	die "could not derive the sandbox probe from berth-bootstrapper.service"
cat >"$WORK/files/berth-boot-report.service" <<'EOF'
[Unit]
Description=Berth boot test report
After=berth-bootstrapper.service containerd.service systemd-networkd-wait-online.service
After=berth-sandbox-probe.service

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
check kubelet-before-probe "$(cat /run/berth-probe/kubelet-before 2>&1)"
check probe-result "$(systemctl show -P Result berth-sandbox-probe.service)"
check tpm-getrandom-rc "$(cat /run/berth-probe/tpm-rc 2>&1)"
for f in /etc/kubernetes/pki/ca.crt /etc/kubernetes/admin.conf /etc/kubernetes/kubelet.conf \
	/etc/kubernetes/manifests/kube-apiserver.yaml /etc/kubernetes/manifests/etcd.yaml \
	/var/lib/kubelet/config.yaml /var/lib/kubelet/kubeadm-flags.env; do
	check "file:$f" "$(test -s $f && echo present || echo missing)"
done
check kubelet-cgroup-driver "$(sed -n 's/^cgroupDriver: //p' /var/lib/kubelet/config.yaml 2>&1)"
check kubelet-runtime-endpoint "$(sed -n 's/^containerRuntimeEndpoint: //p' /var/lib/kubelet/config.yaml 2>&1)"
check kubelet-pause-image "$(grep -o 'pod-infra-container-image=[^ "]*' /var/lib/kubelet/kubeadm-flags.env 2>&1)"
check containerd-sandbox-image "$(sed -n 's/^ *sandbox_image = "\(.*\)"/\1/p' /etc/containerd/config.toml)"
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
echo "--- journal of berth-sandbox-probe.service"
journalctl -b --no-pager -o cat -u berth-sandbox-probe.service | grep -v '^\[' | tail -n 25
echo "--- journal of kubelet.service"
journalctl -b --no-pager -o cat -u kubelet.service | tail -n 8
echo "--- journal of berth-bootstrapper.service"
journalctl -b --no-pager -o cat -u berth-bootstrapper.service | tail -n 30
echo "--- boot time"
systemd-analyze time 2>&1 | head -n 2
echo BERTH-BOOT-REPORT-END
systemctl poweroff --no-block
EOF
chmod 0755 "$WORK/files/berth-boot-report" "$WORK/files/berth-sandbox-probe"

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
write $WORK/files/probe-kubeadm.yaml /etc/berth/probe-kubeadm.yaml
write $WORK/files/berth-sandbox-probe /usr/local/sbin/berth-sandbox-probe
write $WORK/files/berth-sandbox-probe.service /etc/systemd/system/berth-sandbox-probe.service
symlink /etc/systemd/system/multi-user.target.wants/berth-sandbox-probe.service /etc/systemd/system/berth-sandbox-probe.service
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
	got=$(printf '%s\n' "$report" | sed -n "s|^CHECK $1 ||p")
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
expect kubelet-before-probe disabled
expect probe-result success
expect tpm-getrandom-rc 00000000
expect enabled:kubelet enabled
expect active:kubelet active
for f in /etc/kubernetes/pki/ca.crt /etc/kubernetes/admin.conf /etc/kubernetes/kubelet.conf \
	/etc/kubernetes/manifests/kube-apiserver.yaml /etc/kubernetes/manifests/etcd.yaml \
	/var/lib/kubelet/config.yaml /var/lib/kubelet/kubeadm-flags.env; do
	expect "file:$f" present
done
expect kubelet-cgroup-driver systemd
expect kubelet-runtime-endpoint "unix:///run/containerd/containerd.sock"
pause=$(printf '%s\n' "$report" | sed -n 's|^CHECK containerd-sandbox-image ||p')
expect kubelet-pause-image "pod-infra-container-image=$pause"
expect failed-units ""
if ((fail)); then
	die "boot test failed (console: $console)"
fi
echo "image/boot-test.sh: boot test passed in $((end - start)) s" >&2
