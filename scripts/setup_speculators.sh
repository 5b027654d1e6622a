#!/usr/bin/env bash
# Create .venv-speculators, the reference projects' environment: vllm-project/speculators 0.9.0, z-lab's dflash 0.1.0
# (DFlash2DraftModel), NVIDIA Model-Optimizer 0.47.0 and SpecForge 0.2.0 (their Domino code), apart from dflashkit's
# (speculators pins transformers 5.19, dflashkit 5.24), for the opt-in tests that run dflashkit's exports through the
# references' own models and compare with dflashkit's (`pytest -m speculators`). Idempotent; about 1.6 GB, a minute.
#   torch 2.13.0 (the CPU wheel) on its own line; speculators==0.9.0, hs-connectors==0.9.0, dflash==0.1.0,
#   nvidia-modelopt==0.47.0 and specforge==0.2.0 with --no-deps; then the pinned rest from requirements-speculators.txt.
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
run "$VENV/bin/python" -m pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 dflash==0.1.0 \
  nvidia-modelopt==0.47.0 specforge==0.2.0
run "$VENV/bin/python" -m pip install -r requirements-speculators.txt
run "$VENV/bin/python" -c "import speculators; from speculators.utils.loading import load_model_layers; import dflash.model
from modelopt.torch.speculative.plugins.hf_domino import HFDominoModel
from specforge.modeling.draft.domino import DominoDraftModel"
echo "$WANT" > "$STAMP"
echo "[setup_speculators] done: $("$VENV/bin/python" -c 'from importlib.metadata import version; print("speculators", version("speculators"))')"
