#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine, then runs the
# steps of `make test` one by one and prints how long each took.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=(deps check-generate lint check-monitoring build mini-build test-unit fuzz-short test-image test-e2e)
declare -A took
total_start=$(date +%s)
for step in "${steps[@]}"; do
  start=$(date +%s)
  echo "=== step ${step}"
  if [ "$step" = deps ]; then ./scripts/install-deps.sh; else make "$step"; fi
  took[$step]=$(( $(date +%s) - start ))
  echo "=== step ${step}: ${took[$step]} s"
done
echo "=== step times:"
for step in "${steps[@]}"; do printf '===   %-16s %5d s\n' "$step" "${took[$step]}"; done
printf '===   %-16s %5d s\n' total "$(( $(date +%s) - total_start ))"
