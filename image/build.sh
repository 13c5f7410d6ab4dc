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
#   IMAGE_CMDLINE       the kernel command line baked into the UKI
#
# Output: $IMAGE_OUT/berth-root (the image's root directory), $IMAGE_OUT/berth-root.manifest (packages),
# $IMAGE_OUT/berth-root.env (what was built, for tests), $IMAGE_OUT/berth.efi (the unified kernel image:
# systemd-stub, kernel, initrd, os-release, IMAGE_CMDLINE) and $IMAGE_OUT/berth.measurements.yaml (the
# PCR 4 and PCR 11 values it produces, as a policy file for berth policy merge). Caches: Debian packages in
# $BERTH_CACHE/image/apt; the installed OS before Berth's files (mkosi's incremental cache) in
# $BERTH_CACHE/image/os-<hash>, keyed by mkosi.conf and mkosi.skeleton/, so changing the package list
# rebuilds it and nothing else does (`make image-clean` drops it).
set -euo pipefail

IMAGE_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$IMAGE_DIR/.." && pwd)
CACHE=${BERTH_CACHE:-/var/cache/berth}
OUT=${IMAGE_OUT:-$IMAGE_DIR/mkosi.output}
ATTESTATION=${IMAGE_ATTESTATION:-tpm}
METADATA=${IMAGE_METADATA:-static}
BOOTSTRAPPER=${BERTH_BOOTSTRAPPER:-$ROOT/bin/bootstrapper}
CMDLINE=${IMAGE_CMDLINE:-root=LABEL=berth-root rw console=ttyS0 panic=-1}

die() { echo "image/build.sh: $*" >&2; exit 1; }

case $ATTESTATION in tpm | tdx) ;; *) die "IMAGE_ATTESTATION must be tpm or tdx, not '$ATTESTATION'" ;; esac
case $METADATA in static | mini | qemu | gcp | aws | azure) ;; *) die "IMAGE_METADATA must be static, mini, qemu, gcp, aws or azure, not '$METADATA'" ;; esac
[ "$(id -u)" = 0 ] || die "mkosi needs root"
command -v mkosi >/dev/null || die "mkosi is not installed (scripts/install-deps.sh installs it)"
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
	--environment="BERTH_INITRD_CACHE=$osdir/initrd" \
	build)
end=$(date +%s)

[ -d "$OUT/berth-root/usr/lib/systemd" ] || die "mkosi did not produce $OUT/berth-root"
# The unified kernel image and, computed from it, the measurements it will produce.
uki_start=$(date +%s)
BERTH_CLI=${BERTH_CLI:-$ROOT/bin/berth} "$IMAGE_DIR/uki.sh" "$OUT/berth-root" "$CMDLINE" "$OUT/berth.efi" "$OUT/berth.measurements.yaml"
uki_end=$(date +%s)
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
} >"$OUT/berth-root.env"
size=$(du -sh "$OUT/berth-root" | cut -f1)
echo "image/build.sh: built $OUT/berth-root ($size) in $((end - start)) s" >&2
