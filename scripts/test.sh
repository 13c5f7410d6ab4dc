#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine, then runs `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
make test
