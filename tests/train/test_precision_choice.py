"""dtype: auto on a CPU (dflashkit.train.precision_choice): bf16 only when measured faster by the margin, the choice
kept in the store and timed again when stale, the environment's override, a run keeping its precision for life —
with injected timings — and one real timing of each precision on a tiny drafter."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dflashkit.cpu_products.choice import PRECISIONS, Store
from dflashkit.errors import ConfigError
from dflashkit.train import precision_choice
from dflashkit.train.memory import StepShape
from dflashkit.train.precision_choice import MARGIN, TRAINING, choose_precision, geometry_key
from helpers.choices import set_choice
from tests.helpers.train_runs import DRAFTER, cfg_for, make_samples
from tests.train.test_blocks import tiny_config

SHAPE = StepShape(rows=1, tokens=64, blocks=8)


def stored_choices(path: Path) -> dict:
    return Store(path).read(TRAINING.usable_entry(PRECISIONS))


def _timer(fp32: float, bf16: float, calls: list[bool]):
    def timer(cfg, shape, is_bf16: bool) -> float:
        calls.append(is_bf16)
        return bf16 if is_bf16 else fp32

    return timer


def test_bf16_only_when_faster_by_the_margin_and_the_choice_is_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_choice(monkeypatch, "train_precision", None)
    cfg, path, calls = tiny_config(), tmp_path / "store.json", []
    assert choose_precision(cfg, SHAPE, _timer(0.010, 0.010 / (MARGIN - 0.05), calls), store=Store(path)) == (
        "fp32",
        {"fp32": 10.0, "bf16": round(10.0 / (MARGIN - 0.05), 2)},
    )
    assert calls == [False, True]
    wide = StepShape(rows=1, tokens=64, blocks=16)  # another shape: timed on its own
    choice, timings = choose_precision(cfg, wide, _timer(0.020, 0.010, calls), store=Store(path))
    assert (choice, timings) == ("bf16", {"fp32": 20.0, "bf16": 10.0})
    stored = stored_choices(path)
    assert stored[geometry_key(cfg, SHAPE)]["choice"] == "fp32" and stored[geometry_key(cfg, wide)]["choice"] == "bf16"

    def never(*a) -> float:
        raise AssertionError("a stored choice is not timed again")

    assert choose_precision(cfg, wide, never, store=Store(path)) == ("bf16", {})


def test_a_stale_or_damaged_store_is_timed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, "train_precision", None)
    cfg, path = tiny_config(), tmp_path / "store.json"
    old = time.time() - 30 * 86400
    key = geometry_key(cfg, SHAPE)
    path.write_text(json.dumps({"choices": {key: {"choice": "bf16", "fp32_ms": 9, "bf16_ms": 1, "measured_at": old}}}))
    calls: list[bool] = []
    assert choose_precision(cfg, SHAPE, _timer(0.01, 0.01, calls), store=Store(path))[0] == "fp32"
    assert calls == [False, True]
    path.write_text("{not json")
    assert stored_choices(path) == {}
    assert choose_precision(cfg, SHAPE, _timer(0.03, 0.01, calls), store=Store(path))[0] == "bf16"


def test_ranks_sum_their_timings_and_do_not_read_the_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, "train_precision", None)
    cfg, path, calls = tiny_config(), tmp_path / "store.json", []
    choose_precision(cfg, SHAPE, _timer(0.03, 0.01, calls), store=Store(path))  # stored: bf16

    def peer_finds_bf16_slow(ms: torch.Tensor) -> torch.Tensor:
        return ms + torch.tensor([10.0, 100.0], dtype=ms.dtype)

    choice, timings = choose_precision(
        cfg, SHAPE, _timer(0.03, 0.01, calls), store=Store(path), all_reduce=peer_finds_bf16_slow
    )
    assert (choice, timings) == ("fp32", {"fp32": 40.0, "bf16": 110.0})
    assert calls == [False, True, False, True]


def test_the_environment_names_one_and_a_bad_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*a) -> float:
        raise AssertionError("not timed")

    set_choice(monkeypatch, "train_precision", "bf16")
    assert choose_precision(tiny_config(), SHAPE, never, use_store=False) == ("bf16", {})
    set_choice(monkeypatch, "train_precision", "fp16")
    with pytest.raises(ConfigError, match="DFLASHKIT_CHOICES: train_precision='fp16': expected one of fp32, bf16"):
        choose_precision(tiny_config(), SHAPE, never, use_store=False)


def test_both_precisions_time_a_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, "train_precision", None)
    from dflashkit.train.step_cost import time_drafter_step

    timer = lambda c, s, bf16: time_drafter_step(c, s, steps=1, bf16=bf16)  # noqa: E731
    choice, timings = choose_precision(tiny_config(), SHAPE, timer, use_store=False)
    assert choice in ("fp32", "bf16") and set(timings) == {"fp32", "bf16"}
    assert all(0 < t < 60_000 for t in timings.values())


def test_a_run_records_its_precision_and_keeps_it_on_resume(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A fresh run under dtype: auto times both (here: bf16 twice as fast), trains under bf16 autocast and records
    it; resumed where the machine would now choose fp32, it keeps bf16. An explicit dtype always wins."""
    from dflashkit.target.model import Target
    from dflashkit.train.loop import train

    target = Target.load(tiny_llama_dir)
    set_choice(monkeypatch, "train_precision", None)
    set_choice(monkeypatch, "store", "off")
    calls: list[bool] = []
    monkeypatch.setattr("dflashkit.train.step_cost.time_drafter_step", lambda c, s, steps, bf16: 0.01 if bf16 else 0.02)
    samples = make_samples(target, [1, 3, 5], n=3)
    drafter = {**DRAFTER, "target_layer_ids": [1, 3, 5]}

    def kill(end) -> None:
        if end.step == 2:
            raise RuntimeError("simulated kill")

    seen = []
    with pytest.raises(RuntimeError, match="simulated kill"):
        train(cfg_for(tmp_path / "run", drafter=drafter, max_steps=4, save_every=2), dataset=samples, target=target,
              callbacks=[kill, seen.append])  # fmt: skip
    assert "precision: fp32 20 ms, bf16 10 ms a step on this machine → bf16" in capsys.readouterr().out
    assert seen[-1].run.autocast_dtype == torch.bfloat16
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "train_state.pt", weights_only=True)
    assert state["state"]["precision"] == "bf16"
    monkeypatch.setattr(precision_choice, "choose_precision", lambda *a, **k: calls.append(True) or ("fp32", {}))
    seen.clear()
    train(cfg_for(tmp_path / "run", drafter=drafter, max_steps=4, save_every=2), dataset=samples, target=target,
          callbacks=[seen.append])  # fmt: skip
    assert not calls and seen[-1].run.state.precision == "bf16" and seen[-1].run.autocast_dtype == torch.bfloat16
    train(cfg_for(tmp_path / "fp32", drafter=drafter, max_steps=1, dtype="fp32"), dataset=samples, target=target,
          callbacks=[seen.append])  # fmt: skip
    assert not calls and seen[-1].run.state.precision == "fp32" and seen[-1].run.autocast_dtype is None


def test_info_reports_the_forced_or_stored_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflashkit.diagnose.info import _measured_precision

    def info() -> dict:
        return _measured_precision("train", precision_choice.TRAINING)

    set_choice(monkeypatch, "train_precision", "fp32")  # as the suite runs
    assert _machine_lines_subset(info()) == [
        "  training (CPU)    train_precision=fp32 (DFLASHKIT_CHOICES) for every run"
    ]
    set_choice(monkeypatch, "train_precision", None)
    set_choice(monkeypatch, "store", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    assert "none stored yet" in _machine_lines_subset(info())[0]
    cfg = tiny_config()
    choose_precision(cfg, SHAPE, _timer(0.03, 0.01, []))  # this machine's store in the cache
    assert _machine_lines_subset(info()) == [
        "  training (CPU)    dtype auto, timed per drafter geometry and step shape:",
        f"    {geometry_key(cfg, SHAPE)}: bf16 (fp32 30 ms, bf16 10 ms a step)",
    ]


def _machine_lines_subset(m: dict) -> list[str]:
    """The training-precision lines `dflashkit info` prints under Machine."""
    from dflashkit.diagnose.info import _machine_lines

    base = {"flags": [], "products_by_rows": {}, "products_mode": "auto", "cpu": "x", "threads": 1, "blas": "b"}
    lines = _machine_lines({**base, "torch": "t", "products_store": None, **m})
    start = next(i for i, line in enumerate(lines) if line.startswith("  training (CPU)"))
    end = next(i for i, line in enumerate(lines) if line.startswith("  capture (CPU)"))
    return lines[start:end]
