#!/usr/bin/env bash
# Set up (scripts/setup.sh), run ruff (lint + format check), mypy (the public surface) and the test suite. `.ci/run` calls exactly this.
# Extra arguments go to pytest (e.g. `scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint and format first: a few seconds, and a style slip fails before the long test suite
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the public surface type-checks as users' code reads it (pyproject.toml [tool.mypy])
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
