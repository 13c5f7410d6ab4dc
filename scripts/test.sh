#!/usr/bin/env bash
# The README's test command: installs what the tests need on a fresh Debian machine, then runs the
# steps of `make test` one by one. At the end (also when a step fails) it prints how long each step
# took and every test that skipped, with its reason: Go tests run with -json through
# scripts/testsummary, which prints what plain `go test` prints and records the skips. Under
# CI=true a test whose prerequisite is missing fails (internal/prereq); what is left to skip are
# tests that select themselves out (load harnesses, the image checks outside test-image), listed
# here so that nothing skips silently.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=(deps check-generate lint check-monitoring build mini-build test-unit fuzz-short test-image test-e2e)
declare -A took
work=$(mktemp -d)
skips="$work/skips.tsv"
: >"$skips"
total_start=$(date +%s)
current=""

report() {
  local code=$?
  echo "=== step times:"
  for step in "${steps[@]}"; do
    [ -n "${took[$step]:-}" ] && printf '===   %-16s %5d s\n' "$step" "${took[$step]}"
  done
  [ -n "$current" ] && printf '===   %-16s %5d s (failed)\n' "$current" "$(( $(date +%s) - start ))"
  printf '===   %-16s %5d s\n' total "$(( $(date +%s) - total_start ))"
  echo "=== skipped tests: $(wc -l <"$skips")"
  while IFS=$'\t' read -r step pkg test reason; do
    printf '===   [%s] %s %s: %s\n' "$step" "$pkg" "$test" "$reason"
  done <"$skips"
  rm -rf "$work"
  exit "$code"
}
trap report EXIT

for step in "${steps[@]}"; do
  start=$(date +%s)
  current=$step
  echo "=== step ${step}"
  case "$step" in
    deps)
      ./scripts/install-deps.sh
      go build -o "$work/testsummary" ./scripts/testsummary
      ;;
    *)
      make "$step" GOTEST_FLAGS="-race -count=1 -json" 2>&1 | "$work/testsummary" -step "$step" -skips "$skips"
      ;;
  esac
  took[$step]=$(( $(date +%s) - start ))
  current=""
  echo "=== step ${step}: ${took[$step]} s"
done
