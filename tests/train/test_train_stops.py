"""Tests of how a training run stops: a NaN loss or weights gone non-finite stop it naming the step (the last finite
checkpoint kept, no final/), the CLI exits non-zero then; SIGINT (also for a process started in the background)
finishes the step and saves; a time budget stops cleanly."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import read_tensors
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.target.model import Target
from dflashkit.train.loop import TrainingDiverged, train
from dflashkit.train.state import latest_checkpoint
from helpers.train_runs import DRAFTER, cfg_for, make_samples, write_tokens_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def samples(target: Target) -> list[Sample]:
    return make_samples(target, default_drafter_config(target, **DRAFTER).target_layer_ids)


def test_nan_loss_saves_and_stops(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    def poison(step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step == 3 else loss

    with pytest.raises(TrainingDiverged, match="step 3") as err:
        train(cfg_for(tmp_path, save_every=0), dataset=samples, target=target, loss_hook=poison)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000002" and str(ckpt) in str(err.value)
    assert all(torch.isfinite(v).all() for v in read_tensors(ckpt).values())


def test_weights_gone_non_finite_stop_the_run_and_nothing_of_them_is_saved(
    tmp_path: Path, target: Target, samples: list[Sample], monkeypatch
) -> None:
    """A finite loss and gradient whose update leaves inf/NaN in the weights (here: an optimizer step poisoned at
    step 4) stops the run naming the step; the last checkpoint stays the last finite one; no final/ is written."""
    real_step = torch.optim.AdamW.step
    calls = []

    def poisoned(self, *a, **kw):
        out = real_step(self, *a, **kw)
        calls.append(1)
        if len(calls) == 4:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned)
    with pytest.raises(TrainingDiverged, match=r"non-finite \(inf/NaN\) in the update of step 4") as err:
        train(cfg_for(tmp_path, save_every=3), dataset=samples, target=target)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000003" and f"the last finite checkpoint is {ckpt}" in str(err.value)
    assert all(torch.isfinite(v).all() for v in read_tensors(ckpt).values())
    assert not (tmp_path / "final").exists() and not (tmp_path / "checkpoints" / "step-000004").exists()


def test_cli_exits_non_zero_when_training_diverges(tmp_path: Path, tiny_llama_dir: Path, capsys) -> None:
    tokens = tmp_path / "t.jsonl"
    tokens.write_text(
        "".join(
            json.dumps(
                {"id": f"s{i}", "input_ids": [3 + i, 4, 5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]}
            )
            + "\n"
            for i in range(4)
        )
    )
    rc = main(
        [
            "train",
            "-",
            f"tokens={tokens}",
            "online=true",
            f"target={tiny_llama_dir}",
            f"out={tmp_path / 'r'}",
            "lr=1e12",  # the largest lr the door lets in: the weights overflow within steps
            "warmup_ratio=0",
            "max_steps=4",
            "grad_clip=0",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "non-finite" in err, err
    assert not (tmp_path / "r" / "final").exists()


def test_sigint_finishes_step_and_saves(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    def interrupt(end) -> None:
        if end.step == 2:
            signal.raise_signal(signal.SIGINT)  # goes through the installed handler

    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under nohup / `&`
    result = train(cfg_for(tmp_path, save_every=0), dataset=samples, target=target, callbacks=[interrupt])
    assert result.stopped == "interrupted" and result.step == 2 and result.final_dir is None
    assert latest_checkpoint(tmp_path).name == "step-000002"
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler restored
    done = train(cfg_for(tmp_path, save_every=0), dataset=samples, target=target)
    assert done.stopped == "completed" and done.step == 6 and (tmp_path / "final" / "model.safetensors").is_file()


def test_time_budget_stops_cleanly(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    result = train(cfg_for(tmp_path, max_steps=1000, time_budget_minutes=1e-6), dataset=samples, target=target)
    assert result.stopped == "time_budget" and result.step == 1
    assert (tmp_path / "final" / "config.json").is_file() and latest_checkpoint(tmp_path).name == "step-000001"


def test_cli_sigint_from_background_saves_and_exits_130(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A real `dflashkit train` process started as `&`/nohup starts it (SIGINT inherited as SIG_IGN): SIGINT
    still finishes the step, saves, and the exit code says "stopped, not finished" (130)."""
    import os
    import subprocess
    import sys
    import time

    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 4)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from dflashkit.cli import main; sys.exit(main())",
        "train",
        "-",
        "--no-progress",
        f"tokens={tokens}",
        "online=true",
        f"target={tiny_llama_dir}",
        f"out={out}",
        "max_steps=100000",
        "save_every=0",
        "drafter.num_hidden_layers=1",
        "drafter.block_size=4",
        "max_tokens=40",
        "tensorboard=false",
    ]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        text = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, text[-2000:]
    assert "interrupted at step" in text and latest_checkpoint(out) is not None


def test_a_run_directory_whose_latest_pointer_is_lost_is_not_restarted_over_its_checkpoints(
    tmp_path: Path, target: Target, samples: list[Sample]
) -> None:
    """`latest` missing while checkpoints are there (a run killed between saving its first checkpoint and naming it,
    or a removed pointer): a fresh run would keep those files as its own steps ("same step twice: keep the first"),
    so it is refused, naming the newest checkpoint to resume from; a `latest` naming nothing says the same."""
    from dflashkit.errors import CheckpointError

    train(cfg_for(tmp_path, save_every=2, max_steps=4), dataset=samples, target=target)
    pointer = tmp_path / "latest"
    pointer.unlink()
    with pytest.raises(
        CheckpointError,
        match=r"holds saved checkpoints \(newest step-000004\) but .*latest.* missing: "
        r"write checkpoints/step-000004 into .*latest to resume from it, or use a new `out`",
    ):
        train(cfg_for(tmp_path, save_every=2, max_steps=6), dataset=samples, target=target)
    pointer.write_text("checkpoints/step-000009\n")
    with pytest.raises(
        CheckpointError,
        match=r"names 'checkpoints/step-000009', which has no train_state.pt; the "
        r"newest saved checkpoint here is checkpoints/step-000004",
    ):
        latest_checkpoint(tmp_path)
    pointer.write_text("checkpoints/step-000004\n")  # the fix the message gives: resumes
    assert train(cfg_for(tmp_path, save_every=2, max_steps=6), dataset=samples, target=target) is not None
    assert latest_checkpoint(tmp_path).name == "step-000006"


def test_checkpoints_and_validation_passes_by_minutes_of_training(
    tmp_path: Path, target: Target, samples: list[Sample], monkeypatch
) -> None:
    """`save_every_minutes` / `eval_every_minutes`: a checkpoint / validation pass once that much training time (the
    agreed step-time sum) has passed since the last, whatever the step count; with `save_every` too, either comes
    first. A fake clock: each step takes 25 s of training time."""
    import dflashkit.train.loop as loop

    monkeypatch.setattr(loop, "_agreed_elapsed", lambda run: 25.0 * run.state.step)
    validated = []
    real = loop._validate_and_keep
    monkeypatch.setattr(
        loop, "_validate_and_keep", lambda run, epoch: validated.append(run.state.step) or real(run, epoch)
    )
    cfg = cfg_for(
        tmp_path, max_steps=9, save_every=0, save_every_minutes=1.0, eval_every_minutes=1.5, val_samples=1,
        keep_checkpoints=0,
    )  # fmt: skip
    train(cfg, dataset=samples, target=target)
    steps = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "checkpoints").iterdir())
    assert steps == [3, 6, 9]  # 75 s, 150 s, 225 s: each a minute or more after the last (9: also the end)
    assert validated == [4, 8, 9]  # 100 s, 200 s, then the end's pass
    train(cfg_for(tmp_path / "both", max_steps=6, save_every=4, save_every_minutes=1.0, keep_checkpoints=0),
          dataset=samples, target=target)  # fmt: skip
    both = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "both" / "checkpoints").iterdir())
    assert both == [3, 4, 6]  # 3: 75 s after the start; 4: its step count; 6: the end (50 s after 4)
