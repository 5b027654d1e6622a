"""The reference projects' own environments for the opt-in tests: .venv-speculators (scripts/setup_speculators.sh:
speculators 0.9.0 and z-lab's dflash 0.1.0), and running a helper script of tests/helpers inside it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

SPECULATORS_PYTHON_ENV = "DFLASHKIT_SPECULATORS_PYTHON"
HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def in_speculators(helper: str, inputs: dict, tmp_path: Path, *args: Path) -> dict:
    """Save `inputs`, run tests/helpers/`helper` in .venv-speculators (`args` before the two files), load its output."""
    src, dst = tmp_path / f"{helper}.in.pt", tmp_path / f"{helper}.out.pt"
    torch.save(inputs, src)
    cmd = [str(speculators_python()), str(HELPERS / helper), *map(str, args), str(src), str(dst)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(dst)


def speculators_python() -> Path | None:
    """$DFLASHKIT_SPECULATORS_PYTHON, else the checkout's .venv-speculators (scripts/setup_speculators.sh)."""
    env = os.environ.get(SPECULATORS_PYTHON_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    candidate = Path(__file__).resolve().parents[2] / ".venv-speculators" / "bin" / "python"
    return candidate if candidate.is_file() else None
