#!/usr/bin/env bash
# The CUDA path in one prepared check (scripts/gpu_check.py): a tiny random Qwen3 target, every head through
# prepare → capture → train (bf16, flex attention) → eval chain + DDTree (greedy-equal) → convert, torchrun on one
# rank (DDP process group, FSDP2) over NCCL, peak memory against the pre-flight estimate. Minutes on one GPU.
#
#   bash scripts/gpu_check.sh              # a GPU machine with its own CUDA torch: .venv if present, else python3
#   bash scripts/gpu_check.sh --dry        # this CPU, fp32 and gloo: the same steps (CI runs it)
#   OUT=DIR bash scripts/gpu_check.sh      # where gpu_check.json / gpu_check.md go (default runs/gpu_check)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" scripts/gpu_check.py "$@"
