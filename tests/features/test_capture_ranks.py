"""Capture split over torchrun ranks (2 gloo processes on CPU): the same files as a one-process capture, and a run
killed at a random moment resumes — with 2 ranks or with 1 — to those same files, nothing lost or duplicated."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashkit.features.manifest import Manifest
from dflashkit.features.rank_shards import owned_by
from tests.features.test_capture import make_samples

LENGTHS = [150 + (k * 37) % 100 for k in range(64)]  # ~12.8K tokens: a kill lands mid-run


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    """tokens.jsonl, a launcher script, and the one-process reference capture."""
    from dflashkit.cli import main

    tmp = tmp_path_factory.mktemp("ranks")
    tokens = tmp / "tokens.jsonl"
    tokens.write_text(
        "".join(
            json.dumps({"id": s.id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.int().tolist()}) + "\n"
            for s in make_samples(LENGTHS)
        )
    )
    launcher = tmp / "dflashkit_cli.py"  # the console script's body (see tests/train/test_distributed.py)
    launcher.write_text("import sys\nfrom dflashkit.cli import main\nsys.exit(main())\n")
    args = ["capture", "--target", str(tiny_llama_dir), "--tokens", str(tokens), "--layer-ids", "1,4,6"]
    args += ["--dtype", "fp32", "--shard-tokens", "1200", "--quiet"]
    ref = tmp / "ref"
    assert main([*args, "--out", str(ref)]) == 0
    assert len(Manifest.load(ref).shards) >= 5
    return tmp, launcher, args, ref


def _differences(out: Path, ref: Path) -> list[str]:
    """What differs between two capture directories: files present in one only, and for a differing shard the
    tensors that differ (a readable failure instead of two shards' bytes)."""
    from safetensors.torch import load_file

    def digests(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in sorted(d.iterdir())}

    got, want = digests(out), digests(ref)
    diffs = [f"only in the run: {n}" for n in sorted(set(got) - set(want))]
    diffs += [f"missing from the run: {n}" for n in sorted(set(want) - set(got))]
    for name in sorted(n for n in set(got) & set(want) if got[n] != want[n]):
        if name.endswith(".safetensors"):
            a, b = load_file(out / name), load_file(ref / name)
            keys = sorted(k for k in set(a) | set(b) if k not in a or k not in b or not a[k].equal(b[k]))
            diffs.append(f"{name}: tensors differ: {keys[:8]}")
        else:
            run_text, ref_text = (out / name).read_text()[:2000], (ref / name).read_text()[:2000]
            diffs.append(f"{name}: differs:\n{run_text}\n--- reference:\n{ref_text}")
    return diffs


def _cmd(launcher: Path, args: list[str], out: Path, ranks: int) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--standalone"]
    return [*run, str(launcher), *args, "--out", str(out)]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has stopped: it only waits to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pids: list[int], timeout: float = 60) -> None:
    """Wait until every killed process has stopped; fail naming any that still runs (it could write on)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        for p in pids:  # reap zombies of ours; others vanish when their parent (killed) is reaped
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(p, os.WNOHANG)
        time.sleep(0.01)
    assert not [p for p in pids if _running(p)], "killed processes still run"


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_two_ranks_write_what_one_process_writes(setup, tmp_path):
    tmp, launcher, args, ref = setup
    out = tmp_path / "two"
    _run(_cmd(launcher, args, out, 2), tmp)
    assert _differences(out, ref) == []  # manifest and every shard, byte for byte; no rank records left
    assert not list(out.glob("capture-rank-*")) and not list(out.glob(".*.tmp"))
    assert [owned_by(j, 1, 2) for j in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("resume_ranks", [2, 1])
def test_killed_two_rank_capture_resumes_identically(setup, tmp_path, resume_ranks):
    tmp, launcher, args, ref = setup
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _cmd(launcher, args, out, 2), cwd=tmp, env=_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not list(out.glob("capture-rank-*")):
        time.sleep(0.002)
    tree = _descendants(proc.pid)  # torchrun starts each rank in a session of its own
    for pid in [proc.pid, *tree]:  # torchrun and both ranks, mid-run
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _wait_gone(tree)
    assert not Manifest.load(out).complete  # killed mid-run: finished shards are only in the ranks' records
    assert list(out.glob("capture-rank-*"))
    if resume_ranks == 2:
        _run(_cmd(launcher, args, out, 2), tmp)
    else:
        from dflashkit.cli import main

        assert main([*args, "--out", str(out)]) == 0
    assert _differences(out, ref) == []
