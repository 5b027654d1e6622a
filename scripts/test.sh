#!/usr/bin/env bash
# Set up (scripts/setup.sh), run ruff (lint + format check), mypy (the public surface), the test suite (one worker per
# core) and the mutation check (tests/mutation_check.py: the suite still catches each seeded fault). `.ci/run` calls
# exactly this.
# Extra arguments go to pytest alone (e.g. `scripts/test.sh -m slow`), without the mutation check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint and format first: a few seconds, and a style slip fails before the long test suite
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the public surface type-checks as users' code reads it (pyproject.toml [tool.mypy])
.venv/bin/mypy
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# one worker per core, at most 4 (each test process runs one thread and holds a few GB at its peak); idle
# workers take queued tests from busy ones (worksteal), so one long test does not hold a core's queue back
.venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal
exec .venv/bin/python tests/mutation_check.py
