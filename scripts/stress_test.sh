#!/usr/bin/env bash
# The reliability bar: the test suite of a *fresh clone* passes once alone and then 3 times in a row while two
# busy loops compete for the CPU (what CI or a shared machine looks like).
#
#   scripts/stress_test.sh            # clone HEAD into a temp dir, run `.ci/run` alone, then 3 runs under load
#   RUNS=5 scripts/stress_test.sh     # more loaded runs
#   KEEP=1 scripts/stress_test.sh     # keep the clone (its path is printed)
#
# Commits only: uncommitted changes are not in the clone. Exits non-zero at the first failed run; prints each
# run's wall time and pytest's summary line.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${RUNS:-3}"
CLONE="$(mktemp -d "${TMPDIR:-/tmp}/dflashkit-stress.XXXXXX")"
BUSY=()
cleanup() {
  for pid in "${BUSY[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -z "${KEEP:-}" ]; then rm -rf "$CLONE"; else echo "[stress] clone kept: $CLONE"; fi
}
trap cleanup EXIT INT TERM
git clone -q "$PWD" "$CLONE/repo"
cd "$CLONE/repo"
echo "[stress] fresh clone of $(git rev-parse --short HEAD) in $CLONE/repo"

run_suite() {   # $1: label
  local start end log rc=0
  log="$CLONE/run-$(echo "$1" | tr -c 'A-Za-z0-9' '_').log"
  start=$(date +%s)
  CI=true bash .ci/run </dev/null >"$log" 2>&1 || rc=$?
  end=$(date +%s)
  echo "[stress] $1: exit $rc in $((end - start)) s — $(grep -E '(passed|failed|error)' "$log" | tail -1)"
  if [ "$rc" -ne 0 ]; then tail -60 "$log"; exit "$rc"; fi
}

run_suite "alone (includes setup)"
for _ in 1 2; do python3 -c "while True: pass" & BUSY+=("$!"); done
echo "[stress] two busy loops started (pids ${BUSY[*]})"
for i in $(seq 1 "$RUNS"); do run_suite "loaded run $i/$RUNS"; done
echo "[stress] all $((RUNS + 1)) runs passed"
