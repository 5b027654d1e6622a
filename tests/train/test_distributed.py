"""Real 2-process runs: `torchrun --nproc_per_node 2 <dflashkit CLI> train …` (gloo on CPU) with DDP and with
FSDP2, on a tiny target with online features. Checks each finishes, that only rank 0 wrote (one metrics line
per step, one set of checkpoints, no stray temp files), and that the weights equal a single-process run with the
same global batch (2 rows per step: 1 row on each of 2 ranks vs 2 rows in one process). The FSDP run is also
stopped after its first step and resumed (sharded optimizer state round trip). And the teardown of a DDP run
(`Run.close()`), repeated many times by two ranks pinned to one core, never hangs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import read_tensors
from dflashkit.train.metrics import read_metrics
from helpers.weights_close import assert_close_after_adam

STEPS = 4


def _tokens(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for i in range(5):
            n = 16 + 3 * i
            ids = torch.randint(3, 97, (n,), generator=g).tolist()
            f.write(json.dumps({"id": f"x{i}", "input_ids": ids, "loss_mask": [0] * 3 + [1] * (n - 3)}) + "\n")
    return path


def _args(tokens: Path, target: Path, out: Path, batch_rows: int, *extra: str) -> list[str]:
    return [
        "train",
        "-",
        "--no-progress",
        f"tokens={tokens}",
        "online=true",
        f"target={target}",
        f"out={out}",
        f"max_steps={STEPS}",
        f"batch_rows={batch_rows}",
        "save_every=2",
        "drafter.num_hidden_layers=2",
        "drafter.block_size=4",
        "max_tokens=40",
        "tensorboard=false",
        "noise_std=0.05",
        "lr=2e-3",
        *extra,
    ]


def _torchrun(tmp: Path, args: list[str]) -> subprocess.CompletedProcess:
    # The `dflashkit` console script's body (`python -m dflashkit.cli` registers no commands: cli.py's
    # subcommand modules import `dflashkit.cli`, a different module object than `__main__`).
    launcher = tmp / "dflashkit_cli.py"
    launcher.write_text("import sys\nfrom dflashkit.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", str(launcher), *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_llama_dir: Path) -> tuple[Path, Path]:
    """(tokens file, single-process run dir with 2 rows per step)."""
    from dflashkit.cli import main

    tmp = tmp_path_factory.mktemp("dist")
    tokens = _tokens(tmp / "tokens.jsonl")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(_args(tokens, tiny_llama_dir, tmp / "single", batch_rows=2)) == 0
    finally:
        torch.set_num_threads(old)
    return tokens, tmp / "single"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_two_ranks_matches_single_process(
    mode: str, tmp_path: Path, tiny_llama_dir: Path, single: tuple[Path, Path]
) -> None:
    tokens, single_out = single
    out = tmp_path / mode
    extra = ["fsdp=true"] if mode == "fsdp" else []
    if mode == "fsdp":  # stop after step 1 (time budget: the schedule is unchanged), then resume to the end
        proc = _torchrun(tmp_path, _args(tokens, tiny_llama_dir, out, 1, *extra, "time_budget_minutes=1e-9"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "time_budget at step 1" in proc.stdout
    proc = _torchrun(tmp_path, _args(tokens, tiny_llama_dir, out, 1, *extra))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"dflashkit train: completed at step {STEPS}") == 1  # rank 0 reports, once
    if mode == "fsdp":
        assert "resuming from" in proc.stdout and "step-000001 at step 1" in proc.stdout

    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))  # one writer
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == (
        ["step-000001", "step-000002", "step-000004"] if mode == "fsdp" else ["step-000002", "step-000004"]
    )
    assert not list(out.rglob(".*"))  # no temp files left
    state = torch.load(out / "checkpoints" / "step-000004" / "train_state.pt", weights_only=True)
    assert state["state"]["world_size"] == 2

    ref = read_metrics(single_out / "metrics.jsonl")
    assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in ref], rel=1e-4)
    assert recs[-1]["tokens"] == ref[-1]["tokens"]
    assert recs[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-4)  # same weights: same gradient
    # After Adam steps the weights agree only as far as Adam lets them (see weights_close.py)
    assert_close_after_adam(read_tensors(out / "final"), read_tensors(single_out / "final"), lr=2e-3, steps=STEPS)


_TEARDOWN_RANK = textwrap.dedent("""
    import gc, os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from dflashkit.train.distributed import DistContext
    from dflashkit.train.run import Run

    class NullLogger:
        def close(self):
            pass

    rank, rounds, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})      # both ranks on one core: the worst case
    torch.set_num_threads(1)
    for i in range(rounds):
        dist.init_process_group("gloo", init_method=f"file://{store}-{i}", rank=rank, world_size=2)
        core = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
        module, opt = DDP(core), torch.optim.AdamW(core.parameters(), lr=1e-3)
        for _ in range(2):
            module(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        run = Run(cfg=None, dist=DistContext(rank=rank, world_size=2, initialised_here=True),
                  device=torch.device("cpu"), out=None, target=None, embed=None, lm_head=None, drafter=core,
                  module=module, optimizer=opt, scheduler=None, rows=None, val_rows=None, steps_per_epoch=1,
                  total_steps=1, state=None, logger=NullLogger(), rolling=None, weights=None, autocast_dtype=None)
        del module, opt
        run.close()
        del run                  # the old order (group destroyed while DDP lived) hung here within ~2 rounds
        gc.collect()
    print(f"rank {rank}: {rounds} teardowns", flush=True)
""")


def test_ddp_teardown_never_hangs(tmp_path: Path) -> None:
    """`Run.close()` frees DDP's Reducer before destroying the gloo group; the reverse order deadlocks in the
    Reducer's destructor (seen as torchrun jobs that never exit). 12 rounds on one core; a hang fails fast."""
    script = tmp_path / "teardown_rank.py"
    script.write_text(_TEARDOWN_RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "12", str(tmp_path / "store")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("DDP teardown hung (Run.close order: the wrapper must go before destroy_process_group)")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"rank {r}: 12 teardowns" in out, out[-3000:]


@pytest.mark.slow
def test_torchrun_two_ranks_agree_on_a_timed_compile(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """`compile: auto` timed under DDP (train_compile=measure, torch.compile itself): the ranks time with
    their step times agreed, settle alike (rank 0 says what), and the run completes in step."""
    from dflashkit.cpu_products.compile_choice import EAGER_STEPS, ROUNDS, WARM_STEPS

    steps = WARM_STEPS + EAGER_STEPS + 2 + 2 * ROUNDS + 2
    tokens = _tokens(tmp_path / "tokens.jsonl")
    args = [a for a in _args(tokens, tiny_llama_dir, tmp_path / "run", 1) if not a.startswith("max_steps=")]
    from dflashkit.cpu_products.choice import ENV, with_override

    old = os.environ[ENV]
    os.environ[ENV] = with_override("train_compile", "measure")
    try:
        proc = _torchrun(tmp_path, [*args, f"max_steps={steps}", "save_every=0"])
    finally:
        os.environ[ENV] = old
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = [line for line in proc.stdout.splitlines() if "(timed now) →" in line]
    assert len(verdicts) == 1 and "torch.compile: eager" in verdicts[0], proc.stdout[-3000:]
    assert re.search(r"compiled [\d,.]+ ms a step after [\d,.]+ s compiling", verdicts[0]), verdicts[0]
    assert proc.stdout.count(f"dflashkit train: completed at step {steps}") == 1
