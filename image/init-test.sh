#!/usr/bin/env bash
# Initializes a one-node cluster on the built image: boots the tree under QEMU/TCG with swtpm (as
# boot-test.sh does), lets the image's own berth-bootstrapper.service wait for `berth init`, runs
# `berth init` from the host through a QEMU port forward on 127.0.0.1, and checks through the API
# server that the node registered (kubelet runs under systemd) and the control plane runs.
#
# Usage: image/init-test.sh            (normally through `make image-init-test`, after `make image`)
#
#   IMAGE_ROOT     the tree to boot                                (default: image/mkosi.output/berth-root)
#   BOOT_WORK      scratch dir                                     (default: image/mkosi.output/init)
#   BOOT_IMAGES    container image archives (docker/OCI tar) to import into the guest before the
#                  bootstrapper starts, space separated; nothing can be pulled here, so this must
#                  hold kubeadm's control-plane images and the joinservice image (required)
#   BERTH_CLI      the berth binary                                (default: bin/berth)
#   KUBECTL        kubectl                                         (default: from scripts/build-k8s.sh k8s)
#   INIT_TIMEOUT   seconds for berth init once the node answers    (default: 1800)
#   INIT_ATTEMPTS  how often to run berth init (it resumes)        (default: 3)
#
# Test-only settings go into the disk with debugfs, never into the tree: static metadata with the
# init secret's hash, BERTH_ATTESTATION=insecure-none (berth init then needs no attestation policy),
# BERTH_NEVER_PULL=true, and a unit that imports the archives from a second disk. The guest's
# network is QEMU's user network with restrict=on on a documentation range; only the two forwarded
# ports on the host's loopback reach it.
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$IMAGE_DIR/.." && pwd)
ROOT=${IMAGE_ROOT:-$IMAGE_DIR/mkosi.output/berth-root}
WORK=${BOOT_WORK:-$IMAGE_DIR/mkosi.output/init}
BERTH=${BERTH_CLI:-$REPO/bin/berth}
INIT_TIMEOUT=${INIT_TIMEOUT:-1800}
NODE_IP=198.51.100.15

die() { echo "image/init-test.sh: $*" >&2; exit 1; }
say() { echo "image/init-test.sh: $*" >&2; }

for tool in qemu-system-x86_64 swtpm mkfs.ext4 debugfs python3; do
	command -v "$tool" >/dev/null || die "$tool is not installed (qemu-system-x86, swtpm, e2fsprogs)"
done
[ -d "$ROOT/usr/lib/systemd" ] || die "no image tree at $ROOT (run make image)"
[ -x "$BERTH" ] || die "no berth CLI at $BERTH (run make build)"
[ -n "${BOOT_IMAGES:-}" ] || die "BOOT_IMAGES is empty: name the image archives to import (see the header)"
if [ -z "${KUBECTL:-}" ]; then
	KUBECTL=$("$REPO/scripts/build-k8s.sh" k8s)/kubectl
fi
[ -x "$KUBECTL" ] || die "no kubectl at $KUBECTL"
# The cluster runs the Kubernetes version of the image's own kubeadm.
K8S_VERSION=$("$ROOT/usr/bin/kubeadm" version -o short) || die "the image's kubeadm does not run"
kernel=$(ls "$ROOT"/boot/vmlinuz-* 2>/dev/null | sort -V | tail -n1)
[ -n "$kernel" ] || die "no kernel in $ROOT/boot"
kver=${kernel##*/vmlinuz-}
initrd=$ROOT/boot/initrd.img-$kver
[ -f "$initrd" ] || die "no initrd for $kver in $ROOT/boot"

rm -rf "$WORK"
mkdir -p "$WORK/tpm" "$WORK/files" "$WORK/images" "$WORK/workspace"

pids=()
cleanup() {
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
}
trap cleanup EXIT

# Two loopback ports for the forwards (InitServer and API server).
free_port() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
init_port=$(free_port)
api_port=$(free_port)

# The init secret: berth init reads it as hex; the metadata carries the SHA-256 of its bytes.
secret_hex=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
secret_hash=$(python3 -c 'import hashlib, sys; print(hashlib.sha256(bytes.fromhex(sys.argv[1])).hexdigest())' "$secret_hex")
printf '%s\n' "$secret_hex" >"$WORK/workspace/init-secret"
chmod 0600 "$WORK/workspace/init-secret"

cat >"$WORK/files/bootstrapper.env" <<'EOF'
# init test: the daemon serves only insecure-none so far; images are imported, never pulled.
BERTH_ATTESTATION=insecure-none
# no berth-state partition on the guest's disks: the state disk (LUKS2) is make test-luks's
BERTH_STATE_DISK_BACKEND=none
BERTH_METADATA_FILE=/etc/berth/metadata.json
BERTH_NEVER_PULL=true
BERTH_JOINSERVICE_IMAGE=berth.local/joinservice:dev
EOF
cat >"$WORK/files/metadata.json" <<EOF
{"self": {"name": "init-test-0", "role": "control-plane", "ips": ["$NODE_IP"]},
 "controlPlaneEndpoint": "$NODE_IP:6443",
 "initSecretHash": "$secret_hash"}
EOF
cat >"$WORK/files/berth-import-images.service" <<'EOF'
[Unit]
Description=Berth init test: import container images from the second disk
After=containerd.service
Requires=containerd.service
Before=berth-bootstrapper.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/berth-import-images
StandardOutput=journal+console
EOF
cat >"$WORK/files/berth-import-images" <<'EOF'
#!/bin/sh
set -eu
mkdir -p /run/berth-images
mount -o ro LABEL=berth-images /run/berth-images
for t in /run/berth-images/*.tar; do
	echo "importing $t"
	ctr --address /run/containerd/containerd.sock -n k8s.io images import "$t"
done
umount /run/berth-images
EOF
chmod 0755 "$WORK/files/berth-import-images"

cat >"$WORK/workspace/init.yaml" <<EOF
apiVersion: config.berth.dev/v1alpha1
kind: ClusterConfiguration
clusterName: init-test
kubernetesVersion: $K8S_VERSION
networking: {serviceSubnet: 10.96.0.0/12, podSubnet: 10.244.0.0/16}
apiServer: {certSANs: [$NODE_IP, 127.0.0.1]}
initSecretFile: $WORK/workspace/init-secret
EOF

say "making the disks"
disk=$WORK/disk.raw
truncate -s 4G "$disk"
mkfs.ext4 -q -L berth-root -d "$ROOT" "$disk"
debugfs -w "$disk" -f - >/dev/null 2>"$WORK/debugfs.log" <<EOF
write $WORK/files/bootstrapper.env /etc/berth/bootstrapper.env
write $WORK/files/metadata.json /etc/berth/metadata.json
write $WORK/files/berth-import-images.service /etc/systemd/system/berth-import-images.service
write $WORK/files/berth-import-images /usr/local/sbin/berth-import-images
symlink /etc/systemd/system/multi-user.target.wants/berth-import-images.service /etc/systemd/system/berth-import-images.service
EOF
n=0
for img in $BOOT_IMAGES; do
	[ -f "$img" ] || die "no image archive $img"
	n=$((n + 1))
	cp "$img" "$WORK/images/$n-$(basename "$img")"
done
images_disk=$WORK/images.raw
truncate -s "$(($(du -sm "$WORK/images" | cut -f1) * 2 + 64))M" "$images_disk"
mkfs.ext4 -q -L berth-images -d "$WORK/images" "$images_disk"
rm -rf "$WORK/images"

swtpm socket --tpm2 --tpmstate dir="$WORK/tpm" --ctrl type=unixio,path="$WORK/swtpm.sock" \
	--flags startup-clear --log file="$WORK/swtpm.log" &
pids+=($!)
for _ in $(seq 50); do [ -S "$WORK/swtpm.sock" ] && break; sleep 0.1; done
[ -S "$WORK/swtpm.sock" ] || die "swtpm did not create its socket"

console=$WORK/console.log
say "booting $kver under QEMU/TCG (console: $console); InitServer on 127.0.0.1:$init_port, API server on 127.0.0.1:$api_port"
start=$(date +%s)
qemu-system-x86_64 \
	-machine q35,accel=tcg -cpu max -smp 2 -m 4096 \
	-display none -monitor none -no-reboot \
	-serial "file:$console" \
	-kernel "$kernel" -initrd "$initrd" \
	-append "root=LABEL=berth-root rw console=ttyS0 panic=-1 berth.metadata=static berth.tpm=/dev/tpmrm0" \
	-drive "file=$disk,if=virtio,format=raw" \
	-drive "file=$images_disk,if=virtio,format=raw" \
	-nic "user,restrict=on,net=198.51.100.0/24,model=virtio-net-pci,hostfwd=tcp:127.0.0.1:$init_port-:9000,hostfwd=tcp:127.0.0.1:$api_port-:6443" \
	-chardev "socket,id=chrtpm,path=$WORK/swtpm.sock" -tpmdev emulator,id=tpm0,chardev=chrtpm \
	-device tpm-crb,tpmdev=tpm0 &
pids+=($!)

# Under TCG on a loaded host the API server can miss kubeadm's 4-minute control-plane wait; berth
# init resumes a failed init when run again, which is what an operator would do.
attempts=${INIT_ATTEMPTS:-3}
for attempt in $(seq "$attempts"); do
	say "running berth init, attempt $attempt of $attempts (its log: $WORK/workspace/init.log)"
	init_rc=0
	"$BERTH" init --endpoint "127.0.0.1:$init_port" --config "$WORK/workspace/init.yaml" \
		--workspace "$WORK/workspace" --insecure-skip-attestation \
		--connect-timeout 15m --timeout "${INIT_TIMEOUT}s" >"$WORK/berth-init-$attempt.out" 2>&1 || init_rc=$?
	init_end=$(date +%s)
	cat "$WORK/berth-init-$attempt.out" >&2
	[ "$init_rc" -ne 0 ] || break
done
if [ "$init_rc" -ne 0 ]; then
	die "berth init failed ($init_rc) $attempts times, $((init_end - start)) s after boot started; console: $console"
fi
say "berth init succeeded on attempt $attempt, $((init_end - start)) s after boot started"

kube() {
	"$KUBECTL" --kubeconfig "$WORK/workspace/admin.conf" --server "https://127.0.0.1:$api_port" \
		--tls-server-name "$NODE_IP" --request-timeout 60s "$@"
}
fail=0
for _ in $(seq 60); do
	kube get node init-test-0 >/dev/null 2>&1 && break
	sleep 5
done
kube get nodes -o wide || fail=1
kube get pods -n kube-system -o wide || fail=1
kube get node init-test-0 >/dev/null 2>&1 || { say "node init-test-0 did not register"; fail=1; }
for c in kube-apiserver etcd kube-controller-manager kube-scheduler; do
	phase=$(kube get pod -n kube-system "$c-init-test-0" -o jsonpath='{.status.phase}' 2>/dev/null || true)
	[ "$phase" = Running ] || { say "$c-init-test-0 is '$phase', want Running"; fail=1; }
done
cleanup
pids=()
((fail == 0)) || die "init test failed; console: $console"
say "init test passed: berth init (attempt $attempt) and the control plane on the image in $((init_end - start)) s"
