#!/usr/bin/env bash
# Builds the Berth node image's root tree with mkosi (Debian bookworm, mkosi 14).
#
# Usage: image/build.sh            (normally through `make image`)
#
# Inputs (environment):
#   BERTH_BOOTSTRAPPER  the bootstrapper binary             (default: bin/bootstrapper)
#   BERTH_K8S_BIN       dir with kubelet and kubeadm        (default: output of scripts/build-k8s.sh k8s)
#   IMAGE_OUT           where the tree is written           (default: image/mkosi.output)
#   IMAGE_ATTESTATION   tpm | tdx                           (default: tpm)
#   IMAGE_METADATA      static | mini                       (default: static)
#   BERTH_CACHE         cache root                          (default: /var/cache/berth)
#   BERTH_CLI           the berth binary (policy measure)   (default: bin/berth)
#   IMAGE_CMDLINE       kernel options baked into the UKI after the root's (default: console=ttyS0 panic=-1)
#   IMAGE_STATE_SIZE    MiB of the empty berth-state partition on the disk image (default: 128)
#
# Output: $IMAGE_OUT/berth-root (the image's root directory), $IMAGE_OUT/berth-root.manifest (packages),
# $IMAGE_OUT/berth-root.env (what was built, for tests), $IMAGE_OUT/berth.efi (the unified kernel image:
# systemd-stub, kernel, initrd, os-release, IMAGE_CMDLINE) and $IMAGE_OUT/berth.measurements.yaml (the
# PCR 4 and PCR 11 values it produces, as a policy file for berth policy merge). Caches: Debian packages in
# $BERTH_CACHE/image/apt; the installed OS before Berth's files (mkosi's incremental cache) in
# $BERTH_CACHE/image/os-<hash>, keyed by mkosi.conf and mkosi.skeleton/, so changing the package list
# rebuilds it and nothing else does (`make image-clean` drops it); its initrd next to it, keyed also by
# the initramfs-tools files in mkosi.extra/. The read-only root: $IMAGE_OUT/berth-root.squashfs, its
# dm-verity hash tree berth-root.verity and root hash berth-root.roothash, cached in
# $BERTH_CACHE/image/root-v1-<hash of the tree's content>. The disk: $IMAGE_OUT/berth.raw and berth.qcow2
# (image/disk.sh).
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$IMAGE_DIR/.." && pwd)
CACHE=${BERTH_CACHE:-/var/cache/berth}
OUT=${IMAGE_OUT:-$IMAGE_DIR/mkosi.output}
ATTESTATION=${IMAGE_ATTESTATION:-tpm}
METADATA=${IMAGE_METADATA:-static}
BOOTSTRAPPER=${BERTH_BOOTSTRAPPER:-$ROOT/bin/bootstrapper}
CMDLINE_TAIL=${IMAGE_CMDLINE:-console=ttyS0 panic=-1}

die() { echo "image/build.sh: $*" >&2; exit 1; }

case $ATTESTATION in tpm | tdx) ;; *) die "IMAGE_ATTESTATION must be tpm or tdx, not '$ATTESTATION'" ;; esac
case $METADATA in static | mini | qemu | gcp | aws | azure) ;; *) die "IMAGE_METADATA must be static, mini, qemu, gcp, aws or azure, not '$METADATA'" ;; esac
[ "$(id -u)" = 0 ] || die "mkosi needs root"
command -v mkosi >/dev/null || die "mkosi is not installed (scripts/install-deps.sh installs it)"
for tool in mksquashfs veritysetup; do
	command -v "$tool" >/dev/null || die "$tool is not installed (squashfs-tools, cryptsetup-bin; scripts/install-deps.sh)"
done
[ -x "$BOOTSTRAPPER" ] || die "no bootstrapper binary at $BOOTSTRAPPER (run make build)"

if [ -z "${BERTH_K8S_BIN:-}" ]; then
	BERTH_K8S_BIN=$("$ROOT/scripts/build-k8s.sh" k8s)
fi
for b in kubelet kubeadm; do
	[ -x "$BERTH_K8S_BIN/$b" ] || die "no $b in $BERTH_K8S_BIN"
done

mkdir -p "$OUT" "$CACHE/image/apt"
# One image build at a time per cache: mkosi's caches are not safe to fill concurrently.
exec 9>"$CACHE/image/build.lock"
flock 9
OUT=$(cd "$OUT" && pwd)

# The project's binaries and the rendered settings, as a second extra tree.
stage="$OUT/stage"
rm -rf "$stage"
install -D -m 0755 "$BOOTSTRAPPER" "$stage/usr/bin/bootstrapper"
install -D -m 0755 "$BERTH_K8S_BIN/kubelet" "$stage/usr/bin/kubelet"
install -D -m 0755 "$BERTH_K8S_BIN/kubeadm" "$stage/usr/bin/kubeadm"
mkdir -p "$stage/usr/lib/berth"
sed -e "s/@ATTESTATION@/$ATTESTATION/" -e "s/@METADATA@/$METADATA/" \
	"$IMAGE_DIR/bootstrapper.env.in" >"$stage/usr/lib/berth/bootstrapper.env"

# mkosi's incremental cache lives in its output directory, named after ImageId=. Key it by what
# decides the installed packages.
oshash=$(cd "$IMAGE_DIR" && { cat mkosi.conf; find mkosi.skeleton -type f | LC_ALL=C sort | xargs cat; } | sha256sum | cut -c1-12)
osdir="$CACHE/image/os-$oshash"
mkdir -p "$osdir/debian~bookworm"
# mkosi 14 rebuilds its cache whenever the cache of the "development" image is missing, even without
# a build script (which is what that image is for). An empty directory in its place keeps the cache
# of the final image in use.
mkdir -p "$osdir/debian~bookworm/berth.cache-pre-dev"

# The initrd also depends on Berth's initramfs-tools hook and scripts (the dm-verity root, the overlays).
initrdhash=$(cd "$IMAGE_DIR/mkosi.extra" && find usr/share/initramfs-tools -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
for old in "$osdir"/initrd*; do
	[ "$old" = "$osdir/initrd-$initrdhash" ] || rm -rf "$old"
done

start=$(date +%s)
# mkosi refuses to overwrite its output without --force; --force once keeps the incremental cache.
(cd "$IMAGE_DIR" && mkosi \
	--force \
	--incremental \
	--output-dir="$osdir" \
	--output="$OUT/berth-root" \
	--cache="$CACHE/image/apt" \
	--extra-tree="$IMAGE_DIR/mkosi.extra" \
	--extra-tree="$stage" \
	--environment="BERTH_INITRD_CACHE=$osdir/initrd-$initrdhash" \
	build)
end=$(date +%s)

[ -d "$OUT/berth-root/usr/lib/systemd" ] || die "mkosi did not produce $OUT/berth-root"

# The read-only root: the tree as squashfs (file times from SOURCE_DATE_EPOCH, which mksquashfs
# reads, and owners fixed, so the same tree gives the
# same bytes) and its dm-verity hash tree (salt and UUID derived from the squashfs, so the root hash
# is reproducible too). Both are cached by the tree's content: a build that changed nothing in the
# tree copies them instead of compressing a gigabyte again.
root_start=$(date +%s)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800}
treehash=$(tar -C "$OUT/berth-root" --sort=name --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" --format=gnu -cf - . | sha256sum | cut -c1-16)
rootcache="$CACHE/image/root-v1-$treehash"
if [ ! -s "$rootcache/roothash" ]; then
	rm -rf "$rootcache.tmp"
	mkdir -p "$rootcache.tmp"
	mksquashfs "$OUT/berth-root" "$rootcache.tmp/root.squashfs" -noappend -no-progress -quiet \
		-comp zstd -Xcompression-level 6 -all-root >/dev/null
	salt=$(sha256sum "$rootcache.tmp/root.squashfs" | cut -c1-64)
	u=$(printf '%s/uuid' "$salt" | sha256sum)
	veritysetup format "$rootcache.tmp/root.squashfs" "$rootcache.tmp/root.verity" --salt "$salt" \
		--uuid "${u:0:8}-${u:8:4}-4${u:13:3}-a${u:17:3}-${u:20:12}" >"$rootcache.tmp/format.txt"
	sed -n 's/^Root hash:[[:space:]]*//p' "$rootcache.tmp/format.txt" >"$rootcache.tmp/roothash"
	[ "$(wc -c <"$rootcache.tmp/roothash")" = 65 ] || die "veritysetup format gave no root hash: $(cat "$rootcache.tmp/format.txt")"
	mv "$rootcache.tmp" "$rootcache"
fi
for old in "$CACHE"/image/root-v1-*; do
	[ "$old" = "$rootcache" ] || rm -rf "$old"
done
cp --reflink=auto "$rootcache/root.squashfs" "$OUT/berth-root.squashfs"
cp --reflink=auto "$rootcache/root.verity" "$OUT/berth-root.verity"
roothash=$(cat "$rootcache/roothash")
echo "$roothash" >"$OUT/berth-root.roothash"
root_end=$(date +%s)
# The root comes from the verity device the initrd opens (berth.verity=, initramfs-tools script
# berth-verity), read-only.
CMDLINE="root=/dev/mapper/berth-root ro berth.verity=$roothash $CMDLINE_TAIL"
# The unified kernel image and, computed from it, the measurements it will produce.
uki_start=$(date +%s)
BERTH_CLI=${BERTH_CLI:-$ROOT/bin/berth} "$IMAGE_DIR/uki.sh" "$OUT/berth-root" "$CMDLINE" "$OUT/berth.efi" "$OUT/berth.measurements.yaml"
uki_end=$(date +%s)
disk_start=$(date +%s)
"$IMAGE_DIR/disk.sh" "$OUT/berth.efi" "$OUT/berth-root.squashfs" "$OUT/berth-root.verity" "$OUT/berth.raw" "$OUT/berth.qcow2"
disk_end=$(date +%s)
# OS caches of earlier package lists are about 1 GB each: keep only the current one.
for old in "$CACHE"/image/os-*; do
	[ "$old" = "$osdir" ] || rm -rf "$old"
done
{
	echo "IMAGE_ROOT=$OUT/berth-root"
	echo "IMAGE_ATTESTATION=$ATTESTATION"
	echo "IMAGE_METADATA=$METADATA"
	echo "IMAGE_K8S_BIN=$BERTH_K8S_BIN"
	echo "IMAGE_OS_CACHE=$osdir"
	echo "IMAGE_BUILD_SECONDS=$((end - start))"
	echo "IMAGE_UKI=$OUT/berth.efi"
	echo "IMAGE_UKI_SECONDS=$((uki_end - uki_start))"
	echo "IMAGE_CMDLINE=$CMDLINE"
	echo "IMAGE_MEASUREMENTS=$OUT/berth.measurements.yaml"
	echo "IMAGE_ROOTHASH=$roothash"
	echo "IMAGE_ROOT_SECONDS=$((root_end - root_start))"
	echo "IMAGE_DISK=$OUT/berth.qcow2"
	echo "IMAGE_DISK_RAW=$OUT/berth.raw"
	echo "IMAGE_DISK_SECONDS=$((disk_end - disk_start))"
} >"$OUT/berth-root.env"
size=$(du -sh "$OUT/berth-root" | cut -f1)
echo "image/build.sh: built $OUT/berth-root ($size) in $((end - start)) s; read-only root $((root_end - root_start)) s, UKI $((uki_end - uki_start)) s, disk $((disk_end - disk_start)) s" >&2
