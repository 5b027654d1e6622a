"""scripts/gpu_check.sh stays runnable: its dry mode on this CPU runs the steps the GPU check runs (one head here),
torchrun on one rank with DDP and FSDP2 over gloo included, and writes its JSON and Markdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_dry_gpu_check_passes_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry", "--heads", "dflash", "--steps", "2"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {s["step"]: s for s in report["steps"]}
    assert report["ok"] and report["device"] == "cpu"
    assert "equal" in steps["dflash: greedy-equal to the target"]["found"]
    assert steps["torchrun 1 rank, DDP (gloo)"]["ok"] and steps["torchrun 1 rank, FSDP2 (gloo)"]["ok"]
    assert (tmp_path / "gpu_check.md").read_text().count("| ok |") == len(report["steps"])


def test_without_a_gpu_the_real_check_says_so_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2 and "--dry" in proc.stdout
