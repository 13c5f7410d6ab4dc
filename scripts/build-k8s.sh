#!/usr/bin/env bash
# Builds the upstream binaries Berth's mini cluster (and the OS image) runs, from the Go modules under
# build/, into a versioned cache. Nothing is downloaded except Go modules.
#
# Usage: scripts/build-k8s.sh [COMPONENT...]        (default: all components, in this order)
#
#   component  version   binaries in its bin dir
#   k8s        v1.34.2   kubeadm kubelet kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl
#   etcd       3.6.5     etcd
#   coredns    v1.12.1   coredns   (minimal: only the plugins kubeadm's Corefile uses)
#   flannel    v0.28.4   flanneld  (CGO, static)
#   podbin     1         pause testapp  (Berth's own pod sandbox and e2e workload, static)
#
# Output contract (stable; other scripts rely on it):
#   - stdout: exactly one line per requested component, in the order requested: the absolute path of
#     its bin dir, `${BERTH_CACHE:-/var/cache/berth}/<component>-<version>-<hash12>/bin`. Nothing else
#     goes to stdout; progress and timings go to stderr.
#   - <hash12> is the first 12 hex digits of a sha256 over the component's build inputs (its module
#     under build/, its build recipe and the Go version), so a changed input builds into a new dir.
#   - A dir is complete only when `<dir>/stamp` exists; the script writes it last. Consumers that find
#     a dir without stamp must ignore it (this script rebuilds it).
#   - Warm (every stamp present) the script returns in well under a second and builds nothing.
#   - Concurrent callers are safe: each component is built under an exclusive flock on
#     `${BERTH_CACHE}/locks/<component>.lock`; a second caller waits and then reuses the result.
#   - Builds use GOCACHE=${BERTH_CACHE}/gocache (kept between builds), GOWORK=off, GOTOOLCHAIN=local and
#     -mod=readonly, so go.mod/go.sum under build/ are never rewritten.
#   - Exit status is non-zero when any build fails; the failed component's dir then has no stamp.
#
# Example: KUBE_BIN=$(scripts/build-k8s.sh k8s) && "$KUBE_BIN/kubeadm" version -o short
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${BERTH_CACHE:-/var/cache/berth}
ALL=(k8s etcd coredns flannel podbin)

K8S_VERSION=v1.34.2
K8S_LDFLAGS="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
-X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=34 \
-X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z \
-X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION} -X k8s.io/client-go/pkg/version.gitMajor=1 \
-X k8s.io/client-go/pkg/version.gitMinor=34 -X k8s.io/client-go/pkg/version.gitTreeState=clean"
K8S_CMDS="kubeadm kubelet kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl"

# recipe NAME prints "version<TAB>description of how it is built"; the description is hashed.
recipe() {
  case $1 in
    k8s) printf '%s\t%s\n' "$K8S_VERSION" "cgo=0 ldflags=$K8S_LDFLAGS cmds=$K8S_CMDS" ;;
    etcd) printf '%s\t%s\n' 3.6.5 "cgo=0 ldflags=-s -w pkg=. out=etcd" ;;
    coredns) printf '%s\t%s\n' v1.12.1 "cgo=0 ldflags=-s -w pkg=. out=coredns" ;;
    flannel) printf '%s\t%s\n' v0.28.4 "cgo=1 static tags=netgo,osusergo version=v0.28.4" ;;
    podbin) printf '%s\t%s\n' 1 "cgo=0 ldflags=-s -w pkgs=pause testapp" ;;
    *) return 1 ;;
  esac
}

log() { printf 'build-k8s: %s\n' "$*" >&2; }

# inputs_hash NAME prints the short hash over the component's module files, recipe and Go version.
inputs_hash() {
  local name=$1
  {
    recipe "$name"
    go env GOVERSION GOARCH GOOS
    (cd "$ROOT/build/$name" && find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-12
}

# gobuild DIR OUT ARGS... runs go build in module DIR with the shared cache settings.
gobuild() {
  local dir=$1 out=$2
  shift 2
  (cd "$dir" && GOCACHE="$CACHE/gocache" GOWORK=off GOTOOLCHAIN=local GOFLAGS=-mod=readonly \
    go build -trimpath -o "$out/" "$@")
}

build_one() {
  local name=$1 out=$2 src="$ROOT/build/$1"
  case $name in
    k8s)
      local pkgs=()
      for c in $K8S_CMDS; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
      CGO_ENABLED=0 gobuild "$src" "$out" -ldflags "$K8S_LDFLAGS" "${pkgs[@]}" ;;
    etcd | coredns) CGO_ENABLED=0 gobuild "$src" "$out" -ldflags '-s -w' . ;;
    flannel)
      CGO_ENABLED=1 gobuild "$src" "$out" -tags netgo,osusergo \
        -ldflags '-s -w -X github.com/flannel-io/flannel/pkg/version.Version=v0.28.4 -extldflags "-static"' \
        github.com/flannel-io/flannel && mv "$out/flannel" "$out/flanneld" ;;
    podbin) CGO_ENABLED=0 gobuild "$src" "$out" -ldflags '-s -w' ./pause ./testapp ;;
  esac
}

# ensure NAME builds the component unless its stamped dir exists, and prints the bin dir.
ensure() {
  local name=$1 version hash dir
  version=$(recipe "$name" | cut -f1) || { log "unknown component $name (want: ${ALL[*]})"; return 2; }
  hash=$(inputs_hash "$name")
  dir="$CACHE/$name-$version-$hash"
  if [[ ! -f $dir/stamp ]]; then
    mkdir -p "$CACHE/locks"
    local fd
    exec {fd}>"$CACHE/locks/$name.lock"
    flock "$fd"
    if [[ ! -f $dir/stamp ]]; then
      log "building $name $version into $dir"
      rm -rf "$dir"
      mkdir -p "$dir/bin"
      local start=$SECONDS
      if ! build_one "$name" "$dir/bin" >&2; then
        exec {fd}>&-
        log "building $name failed"
        return 1
      fi
      printf 'component=%s\nversion=%s\nhash=%s\nseconds=%d\nbuilt=%s\n' "$name" "$version" "$hash" \
        "$((SECONDS - start))" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$dir/stamp.tmp"
      mv "$dir/stamp.tmp" "$dir/stamp"
      log "built $name in $((SECONDS - start))s"
    fi
    exec {fd}>&-
  fi
  printf '%s\n' "$dir/bin"
}

command -v go >/dev/null || { log "Go is required"; exit 1; }
want=("$@")
((${#want[@]})) || want=("${ALL[@]}")
for c in "${want[@]}"; do ensure "$c"; done
