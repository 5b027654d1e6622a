#!/usr/bin/env bash
# Create .venv-speculators: vllm-project/speculators 0.9.0 and z-lab's dflash 0.1.0 (DFlash2DraftModel) in their own
# environment (speculators pins transformers 5.19, dflashkit 5.24), for the opt-in tests that run dflashkit's exports
# through speculators' own DFlash, DSpark and DFlash2 models and z-lab's DFlash2DraftModel and compare with dflashkit's
# (`pytest -m speculators`). Idempotent; about 1.5 GB, a minute.
#   torch 2.13.0 (the CPU wheel) on its own line; speculators==0.9.0, hs-connectors==0.9.0 and dflash==0.1.0 with
#   --no-deps; then the
#   pinned rest from requirements-speculators.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-speculators
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.dflashkit-installed"
WANT="$(cat requirements-speculators.txt scripts/setup_speculators.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
LOG="$VENV/setup.log"
echo "[setup_speculators] installing speculators 0.9.0 into $VENV (log: $LOG) …"
run() { "$@" >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; echo "[setup_speculators] failed: $*" >&2; exit 1; }; }
: > "$LOG"
run "$VENV/bin/python" -m pip install --upgrade pip==26.3
run "$VENV/bin/python" -m pip install torch==2.13.0
run "$VENV/bin/python" -m pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0
run "$VENV/bin/python" -m pip install -r requirements-speculators.txt
run "$VENV/bin/python" -c "import speculators; from speculators.utils.loading import load_model_layers; import dflash.model"
echo "$WANT" > "$STAMP"
echo "[setup_speculators] done: $("$VENV/bin/python" -c 'from importlib.metadata import version; print("speculators", version("speculators"))')"
