#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default target (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dflashkit quickstart "$@"
