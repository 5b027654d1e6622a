#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. `.ci/run` calls exactly this.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
