#!/usr/bin/env bash
# Builds the upstream binaries Berth's mini cluster (and the OS image) runs, from the Go modules under
# build/, into a versioned cache. Nothing is downloaded except Go modules.
#
# Usage: scripts/build-k8s.sh [--kubernetes-version VERSION] [COMPONENT...]
#        (default: the default Kubernetes version and all components, in this order)
#        scripts/build-k8s.sh --supported   (prints the supported versions, one a line, default first)
#
#   component  version                 binaries in its bin dir
#   k8s        VERSION                 kubeadm kubelet kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl
#   etcd       the one VERSION names   etcd
#   coredns    the one VERSION names   coredns   (minimal: only the plugins kubeadm's Corefile uses)
#   flannel    v0.28.4                 flanneld  (CGO, static)
#   podbin     1                       pause testapp  (Berth's own pod sandbox and e2e workload, static)
#   versitygw  v1.8.0                  versitygw (an S3-compatible server; only for the backup tests, not in the default list)
#
# VERSION is a supported Kubernetes version or minor (v1.36.3 or v1.36); the supported ones, with the
# etcd and CoreDNS versions each one's kubeadm names, are the rows of internal/k8sversion/versions.tsv,
# the default first (today v1.37.2 with etcd 3.7.0 and CoreDNS v1.14.6; v1.36.3 with etcd 3.6.8 and
# CoreDNS v1.14.2). An unsupported VERSION fails with exit status 2 and the list of supported ones.
# The modules are build/k8s/<version>, build/etcd/<version>, build/coredns/<version>, build/flannel
# and build/podbin.
#
# Output contract (stable; other scripts rely on it):
#   - stdout: exactly one line per requested component, in the order requested: the absolute path of
#     its bin dir, `${BERTH_CACHE:-/var/cache/berth}/<component>-<version>-<hash12>/bin`. Nothing else
#     goes to stdout; progress and timings go to stderr.
#   - <hash12> is the first 12 hex digits of a sha256 over the component's build inputs (its module
#     under build/, its build recipe and the Go version), so a changed input builds into a new dir.
#     Every version has its own dir, so the versions of one component are cached side by side.
#   - A dir is complete only when `<dir>/stamp` exists; the script writes it last. Consumers that find
#     a dir without stamp must ignore it (this script rebuilds it).
#   - Warm (every stamp present) the script returns in well under a second and builds nothing.
#   - Concurrent callers are safe: each component is built under an exclusive flock on
#     `${BERTH_CACHE}/locks/<component>.lock`; a second caller waits and then reuses the result.
#   - Builds use GOCACHE=${BERTH_CACHE}/gocache (kept between builds), GOWORK=off, GOTOOLCHAIN=local and
#     -mod=readonly, so go.mod/go.sum under build/ are never rewritten.
#   - Exit status is non-zero when any build fails; the failed component's dir then has no stamp.
#   - Progress (stderr): a cold build says what it builds, how many modules it fetched, how many
#     packages it compiles (those `go list` calls stale under the same flags and cache), and every
#     30 s or 5 % how many are done, the time so far and the time left at the rate so far.
#
# Example: KUBE_BIN=$(scripts/build-k8s.sh --kubernetes-version v1.36 k8s) && "$KUBE_BIN/kubeadm" version -o short
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${BERTH_CACHE:-/var/cache/berth}
ALL=(k8s etcd coredns flannel podbin)
VERSIONS="$ROOT/internal/k8sversion/versions.tsv"

log() { printf 'build-k8s: %s\n' "$*" >&2; }

# supported prints the supported Kubernetes versions, comma-separated, the default first.
supported() { awk -F'\t' '!/^#/ && NF >= 4 {printf "%s%s", sep, $1; sep=", "}' "$VERSIONS"; }

# select_version WANT sets K8S_VERSION, ETCD_VERSION and COREDNS_VERSION from the row of versions.tsv
# whose version is WANT or whose minor is WANT (empty: the default, the first row).
select_version() {
  local row
  row=$(awk -F'\t' -v want="$1" '!/^#/ && NF >= 4 {
      minor = $1; sub(/\.[0-9]+$/, "", minor)
      if (want == "" || want == $1 || want == minor) { print; exit }
    }' "$VERSIONS")
  if [[ -z $row ]]; then
    log "unsupported Kubernetes version \"${1//[^A-Za-z0-9.+-]/?}\" (supported: $(supported); a minor such as v1.36 picks its row)"
    exit 2
  fi
  IFS=$'\t' read -r K8S_VERSION ETCD_VERSION COREDNS_VERSION _ <<<"$row"
}

want_version=
while (($#)); do
  case $1 in
    --kubernetes-version) (($# >= 2)) || { log "--kubernetes-version needs a value"; exit 2; }; want_version=$2; shift 2 ;;
    --kubernetes-version=*) want_version=${1#*=}; shift ;;
    --supported) awk -F'\t' '!/^#/ && NF >= 4 {print $1}' "$VERSIONS"; exit 0 ;;
    --) shift; break ;;
    -*) log "unknown flag ${1//[^A-Za-z0-9=.+-]/?}"; exit 2 ;;
    *) break ;;
  esac
done
select_version "$want_version"
K8S_MINOR=${K8S_VERSION#v1.}
K8S_MINOR=${K8S_MINOR%%.*}

K8S_LDFLAGS="-s -w -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
-X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${K8S_MINOR} \
-X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z \
-X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION} -X k8s.io/client-go/pkg/version.gitMajor=1 \
-X k8s.io/client-go/pkg/version.gitMinor=${K8S_MINOR} -X k8s.io/client-go/pkg/version.gitTreeState=clean"
K8S_CMDS="kubeadm kubelet kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl"

# recipe NAME prints "version<TAB>description of how it is built"; the description is hashed.
recipe() {
  case $1 in
    k8s) printf '%s\t%s\n' "$K8S_VERSION" "cgo=0 ldflags=$K8S_LDFLAGS cmds=$K8S_CMDS" ;;
    etcd) printf '%s\t%s\n' "$ETCD_VERSION" "cgo=0 ldflags=-s -w pkg=. out=etcd (renamed from the module dir's name)" ;;
    coredns) printf '%s\t%s\n' "$COREDNS_VERSION" "cgo=0 ldflags=-s -w pkg=. out=coredns (renamed from the module dir's name)" ;;
    flannel) printf '%s\t%s\n' v0.28.4 "cgo=1 static tags=netgo,osusergo version=v0.28.4" ;;
    podbin) printf '%s\t%s\n' 1 "cgo=0 ldflags=-s -w pkgs=pause testapp" ;;
    versitygw) printf '%s\t%s\n' v1.8.0 "cgo=0 ldflags=-s -w tool=github.com/versity/versitygw/cmd/versitygw" ;;
    *) return 1 ;;
  esac
}

# module_dir NAME prints the directory of the component's build module.
module_dir() {
  case $1 in
    k8s) printf '%s\n' "$ROOT/build/k8s/$K8S_VERSION" ;;
    etcd) printf '%s\n' "$ROOT/build/etcd/$ETCD_VERSION" ;;
    coredns) printf '%s\n' "$ROOT/build/coredns/$COREDNS_VERSION" ;;
    *) printf '%s\n' "$ROOT/build/$1" ;;
  esac
}

# inputs_hash NAME prints the short hash over the component's module files, recipe and Go version.
inputs_hash() {
  local name=$1
  {
    recipe "$name"
    go env GOVERSION GOARCH GOOS
    (cd "$(module_dir "$name")" && find . -type f \( -name '*.go' -o -name go.mod -o -name go.sum \) -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-12
}

# duration SECONDS prints it as 1h02m, 4m05s or 12s.
duration() {
  local s=$1
  if ((s >= 3600)); then printf '%dh%02dm' $((s / 3600)) $((s % 3600 / 60))
  elif ((s >= 60)); then printf '%dm%02ds' $((s / 60)) $((s % 60))
  else printf '%ds' "$s"; fi
}

# gocmd DIR ARGS... runs the go command in module DIR with the shared cache settings.
gocmd() {
  local dir=$1
  shift
  (cd "$dir" && GOCACHE="$CACHE/gocache" GOWORK=off GOTOOLCHAIN=local GOFLAGS=-mod=readonly go "$@")
}

# Progress is reported at most every PROGRESS_EVERY seconds or PROGRESS_PERCENT percent.
PROGRESS_EVERY=30
PROGRESS_PERCENT=5

# fetch_progress NAME MODULES reads the go command's stderr while it resolves packages, passes it on
# to stderr except its "go: downloading" lines, and says how many modules it has fetched (of at most
# MODULES, the module's build list).
fetch_progress() {
  local name=$1 modules=$2 fetched=0 start=$SECONDS last=$SECONDS line
  while IFS= read -r line; do
    if [[ $line == "go: downloading "* ]]; then
      fetched=$((fetched + 1))
      if ((SECONDS - last >= PROGRESS_EVERY)); then
        log "$name: fetched $fetched modules (of at most $modules), $(duration $((SECONDS - start))) so far"
        last=$SECONDS
      fi
    else
      printf '%s\n' "$line" >&2
    fi
  done
  ((fetched == 0)) || log "$name: fetched $fetched modules in $(duration $((SECONDS - start)))"
}

# build_progress NAME TOTAL reads `go build -v` (one import path per package compiled) and reports how
# far the build is: packages compiled of TOTAL (what go list called stale), time so far, and the time
# left at the rate so far. Anything else (compiler errors) passes through to stderr.
build_progress() {
  local name=$1 total=$2 compiled=0 start=$SECONDS last=$SECONDS lastpct=0 line pct elapsed
  while IFS= read -r line; do
    if [[ $line =~ ^[A-Za-z0-9_.~+/-]+$ ]]; then
      compiled=$((compiled + 1))
      ((total > 0)) || continue
      pct=$((100 * compiled / total))
      ((pct <= 99)) || pct=99
      if ((pct >= lastpct + PROGRESS_PERCENT || SECONDS - last >= PROGRESS_EVERY)); then
        elapsed=$((SECONDS - start))
        log "$name: $compiled of $total packages compiled ($pct%), $(duration "$elapsed") so far, about $(duration $((elapsed * (total - compiled) / compiled))) left"
        last=$SECONDS
        lastpct=$pct
      fi
    else
      printf '%s\n' "$line" >&2
    fi
  done
}

# gobuild DIR OUT ARGS... builds ARGS (build flags, then packages) in module DIR into OUT with the
# shared cache settings, saying on stderr what it fetches and compiles and how far it is.
gobuild() {
  local dir=$1 out=$2 name
  name=${dir#"$ROOT/build/"}
  shift 2
  local modules stale
  modules=$(gocmd "$dir" list -m all 2>/dev/null | wc -l)
  log "$name: resolving its packages (modules not yet in the module cache are fetched first)"
  # Staleness as go build will see it: same flags, same cache. The main packages count too (linked).
  stale=$({ gocmd "$dir" list -trimpath -deps -f '{{if .Stale}}{{.ImportPath}}{{end}}' "$@" 2>&1 1>&3 |
    fetch_progress "$name" "$modules"; } 3>&1 | grep -c . || true)
  log "$name: compiling $stale packages"
  gocmd "$dir" build -v -trimpath -o "$out/" "$@" 2>&1 | build_progress "$name" "$stale"
}

build_one() {
  local name=$1 out=$2 src
  src=$(module_dir "$name")
  case $name in
    k8s)
      local pkgs=()
      for c in $K8S_CMDS; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
      CGO_ENABLED=0 gobuild "$src" "$out" -ldflags "$K8S_LDFLAGS" "${pkgs[@]}" ;;
    # go build names the binary after the module dir (the version); the bin dir names it for the component.
    etcd | coredns) CGO_ENABLED=0 gobuild "$src" "$out" -ldflags '-s -w' . && mv "$out/$(basename "$src")" "$out/$name" ;;
    flannel)
      CGO_ENABLED=1 gobuild "$src" "$out" -tags netgo,osusergo \
        -ldflags '-s -w -X github.com/flannel-io/flannel/pkg/version.Version=v0.28.4 -extldflags "-static"' \
        github.com/flannel-io/flannel && mv "$out/flannel" "$out/flanneld" ;;
    podbin) CGO_ENABLED=0 gobuild "$src" "$out" -ldflags '-s -w' ./pause ./testapp ;;
    versitygw) CGO_ENABLED=0 gobuild "$src" "$out" -ldflags '-s -w' github.com/versity/versitygw/cmd/versitygw ;;
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
      # One more try after a failure: the only thing fetched is Go modules, over the network, and a
      # fetch that failed once (a reset connection, a proxy's 5xx) usually works the second time. A
      # real build error fails twice, in the same words.
      if ! build_one "$name" "$dir/bin" >&2; then
        log "building $name failed; trying once more (a module fetch may have failed on the network)"
        rm -rf "$dir"
        mkdir -p "$dir/bin"
        if ! build_one "$name" "$dir/bin" >&2; then
          exec {fd}>&-
          log "building $name failed"
          return 1
        fi
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
