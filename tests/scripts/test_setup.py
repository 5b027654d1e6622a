"""scripts/setup.sh's install plan, checked without installing anything (`--dry-run`): the torch build it picks on a
machine with and without an NVIDIA GPU, the flags that force it, and pins that name versions a public index serves."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, *args: str, gpus: int | None = None) -> list[str]:
    """Run `setup.sh --dry-run ARGS` with a PATH whose `nvidia-smi` lists `gpus` GPUs (None: no nvidia-smi)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    if gpus is not None:
        # one write per line, a pause after the first: a reader that stops at the first line kills the rest (SIGPIPE)
        lines = "".join(
            f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" + "sleep 0.1\n" * (i == 0) for i in range(gpus)
        )
        smi.write_text("#!/bin/sh\n" + (lines or "echo 'No devices were found' >&2; exit 6\n"))
        smi.chmod(0o755)
    elif smi.exists():
        smi.unlink()
    system_path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    env = {**os.environ, "PATH": f"{bin_dir}:{system_path}"}
    out = subprocess.run(
        ["bash", "scripts/setup.sh", "--dry-run", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _torch_step(plan: list[str]) -> str:
    (step,) = [line for line in plan if "torch==" in line]
    return step


def test_a_machine_without_a_gpu_gets_the_cpu_build(tmp_path):
    plan = _plan(tmp_path, gpus=None)
    assert plan[0] == "[setup] torch 2.13.0, cpu build (auto: no NVIDIA GPU answers nvidia-smi)"
    step = _torch_step(plan)
    if os.uname().sysname == "Linux":  # a local wheel first, else PyTorch's CPU index: never PyPI's CUDA wheel
        assert "--no-index torch==2.13.0 || " in step and "--index-url https://download.pytorch.org/whl/cpu" in step
    assert not any("flash-linear-attention" in line for line in plan)
    # an nvidia-smi that finds no device is a machine without a GPU too
    assert _plan(tmp_path, gpus=0)[0].endswith("cpu build (auto: no NVIDIA GPU answers nvidia-smi)")


def test_a_machine_with_a_gpu_gets_the_cuda_build_and_the_gpu_extra(tmp_path):
    plan = _plan(tmp_path, gpus=8)
    assert plan[0] == "[setup] torch 2.13.0, cuda build (auto: nvidia-smi lists 8 GPU(s))"
    step = _torch_step(plan)
    assert "--index-url" not in step and "--no-index" not in step  # PyPI's Linux wheel is the CUDA build
    assert plan[-1] == "[setup] plan: python -m pip install -c constraints.txt flash-linear-attention==0.6.0"


@pytest.mark.parametrize(("flag", "gpus", "build"), [("--cpu", 8, "cpu"), ("--cuda", None, "cuda")])
def test_a_flag_forces_the_build_whatever_the_machine_has(tmp_path, flag, gpus, build):
    assert _plan(tmp_path, flag, gpus=gpus)[0] == f"[setup] torch 2.13.0, {build} build ({flag})"


def test_every_plan_installs_the_pinned_files_and_the_package(tmp_path):
    for args in ((), ("--cuda",)):
        plan = _plan(tmp_path, *args)
        assert "[setup] plan: python -m pip install -r requirements.txt -c constraints.txt" in plan
        assert "[setup] plan: python -m pip install --no-deps -r requirements-nodeps.txt" in plan
        assert "[setup] plan: python -m pip install --no-deps --no-build-isolation -e ." in plan


def test_an_unknown_argument_is_one_line_and_exit_2():
    out = subprocess.run(["bash", "scripts/setup.sh", "--gpu"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "scripts/setup.sh: unknown argument '--gpu' (expected --cpu, --cuda or --dry-run)"


def test_pins_name_versions_a_public_index_serves():
    """A local build label (`torch==2.13.0+cpu`) is served only by PyTorch's own index: the project's files pin
    versions, and setup.sh picks the build. The torch pin agrees everywhere it is written."""
    pins = {}
    for name in ("requirements.txt", "constraints.txt"):
        for line in (ROOT / name).read_text().splitlines():
            m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
            if m:
                assert "+" not in m.group(2), f"{name}: {line} names a local build label"
                pins.setdefault(m.group(1).lower(), set()).add(m.group(2))
    assert pins["torch"] == {"2.13.0"}
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "TORCH_VERSION=2.13.0" in setup
    assert '"torch>=2.13,<2.14"' in (ROOT / "pyproject.toml").read_text()
