#!/usr/bin/env bash
# The README's main command: on a fresh Debian machine, as root, install what Berth needs, build it
# (Kubernetes and friends are built from their Go modules and cached under /var/cache/berth), and
# bring up a local attested cluster of namespace nodes: 1 control plane and 2 workers.
# Extra arguments go to `berth mini up` (e.g. --workers 3 --tampered-workers 1).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
  echo "mini-up: run as root: the nodes are network and mount namespaces with their own containerd" >&2
  exit 2
fi
./scripts/install-deps.sh
dir=${MINI_DIR:-/var/lib/berth-mini}
make --no-print-directory build mini-build
./bin/berth mini up --dir "$dir" --control-planes 1 --workers 2 "$@"
echo
echo "Use the cluster:   export KUBECONFIG=$dir/admin.conf; kubectl get nodes"
echo "Tear it down:      ./bin/berth mini down --dir $dir"
