"""`compile: auto` inside real training runs (train.compile_choice, Run.step_module, the loop): the trial's compiled
steps are real steps of the run, a compiled step that fails is run again eagerly and recorded unusable, a short run
never compiles, validation runs eager, `compile: true/false` still read — torch.compile replaced by a stand-in whose
calls are counted; one slow test compiles for real and compares the losses with eager training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dflashkit.cpu_products.compile_choice import COMPILED, EAGER, EAGER_STEPS, ROUNDS, WARM_STEPS
from dflashkit.data.samples import Sample
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.compile_choice import TRAIN_COMPILE
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.metrics import read_metrics
from helpers.choices import set_choice
from helpers.train_runs import DRAFTER, cfg_for, make_samples

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRIAL_STEPS = WARM_STEPS + EAGER_STEPS + 2 + 2 * ROUNDS


@pytest.fixture(scope="module")
def samples(target: Target) -> list[Sample]:
    return make_samples(target, default_drafter_config(target, **DRAFTER).target_layer_ids, n=6)


class _Counted(nn.Module):
    """torch.compile's stand-in: the same module, its training calls counted (or failing)."""

    def __init__(self, inner: nn.Module, calls: list[bool], fail: bool) -> None:
        super().__init__()
        self.inner, self.calls, self.fail = inner, calls, fail

    def forward(self, *args):
        self.calls.append(torch.is_grad_enabled())
        if self.fail:
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found\nmore detail")
        return self.inner(*args)


@pytest.fixture
def fake_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Returns (calls, set_fail): torch.compile replaced; the compile store in tmp_path."""
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "store"))
    set_choice(monkeypatch, "store", None)
    set_choice(monkeypatch, "train_compile", None)
    calls: list[bool] = []
    state = {"fail": False}

    def fake(module: nn.Module, **kw):
        assert kw == {"dynamic": True}
        return _Counted(module, calls, state["fail"])

    monkeypatch.setattr(torch, "compile", fake)
    return calls, lambda v: state.update(fail=v)


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]


def test_a_measured_trial_runs_real_steps_and_stores_its_verdict(
    tmp_path: Path, target: Target, samples: list[Sample], fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, _ = fake_compile
    steps = TRIAL_STEPS + 3
    kw = dict(max_steps=steps, save_every=0, eval_every=5, val_samples=1)
    train(cfg_for(tmp_path / "eager", compile="off", **kw), dataset=samples, target=target)
    assert calls == []
    set_choice(monkeypatch, "train_compile", "measure")
    train(cfg_for(tmp_path / "trial", compile="auto", **kw), dataset=samples, target=target)
    # every compiled step of the schedule ran through the stand-in, validation never did
    compiled_steps = 2 + ROUNDS
    assert len(calls) >= compiled_steps and all(calls)
    assert _losses(tmp_path / "trial") == _losses(tmp_path / "eager")  # the same steps, the same math
    (entry,) = TRAIN_COMPILE.stored_choices().values()
    assert entry["choice"] in (EAGER, COMPILED) and entry["eager_ms"] > 0 and entry["compile_s"] >= 0
    assert len(calls) == compiled_steps + (3 if entry["choice"] == COMPILED else 0)


def test_a_failing_compile_reruns_the_step_eagerly_and_is_recorded(
    tmp_path: Path, target: Target, samples: list[Sample], fake_compile, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    calls, set_fail = fake_compile
    steps = WARM_STEPS + EAGER_STEPS + 3
    train(cfg_for(tmp_path / "eager", compile=False, max_steps=steps, save_every=0), dataset=samples, target=target)
    set_fail(True)
    set_choice(monkeypatch, "train_compile", "measure")
    result = train(cfg_for(tmp_path / "f", max_steps=steps, save_every=0), dataset=samples, target=target)
    assert result.step == steps and len(calls) == 1
    assert _losses(tmp_path / "f") == _losses(tmp_path / "eager")  # no step lost, none doubled
    assert "the compiled step failed (RuntimeError: InvalidCxxCompiler" in capsys.readouterr().out
    set_choice(monkeypatch, "train_compile", None)
    (entry,) = TRAIN_COMPILE.stored_choices().values()
    assert entry["unusable"].startswith("RuntimeError: InvalidCxxCompiler") and "more detail" not in entry["unusable"]


def test_a_short_auto_run_stays_eager_and_true_false_still_read(
    tmp_path: Path, target: Target, samples: list[Sample], fake_compile, capsys
) -> None:
    calls, _ = fake_compile
    train(cfg_for(tmp_path / "a", max_steps=TRIAL_STEPS, save_every=0), dataset=samples, target=target)
    out = capsys.readouterr().out
    assert calls == [] and "too little to risk compiling" in out
    assert TRAIN_COMPILE.stored_choices() == {}
    train(cfg_for(tmp_path / "on", compile=True, max_steps=2, save_every=0), dataset=samples, target=target)
    assert calls == [True, True] and "compile: on → compiled" in capsys.readouterr().out
    TrainConfig(out=str(tmp_path / "x"), compile="off").validate()
    with pytest.raises(ConfigError, match='compile = "sometimes": expected auto, on or off'):
        TrainConfig.load(None, ["out=x", "compile=sometimes"])


@pytest.mark.slow
def test_a_really_compiled_step_trains_as_eager_does(
    tmp_path: Path, target: Target, samples: list[Sample], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile itself (inductor, a C++ build on CPU): the same losses as eager within float rounding."""
    set_choice(monkeypatch, "train_compile", None)
    kw = dict(max_steps=4, save_every=0)
    train(cfg_for(tmp_path / "eager", compile="off", **kw), dataset=samples, target=target)
    train(cfg_for(tmp_path / "compiled", compile="on", **kw), dataset=samples, target=target)
    for a, b in zip(_losses(tmp_path / "eager"), _losses(tmp_path / "compiled"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (a, b)


def test_info_lists_the_forced_or_stored_compile_choices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflashkit.diagnose.info import _compile_lines, _measured_compile

    def lines() -> list[str]:
        return _compile_lines(_measured_compile("train", TRAIN_COMPILE), "train")

    set_choice(monkeypatch, "train_compile", "off")  # as the suite runs
    assert lines() == ["  train compile     train_compile=off (DFLASHKIT_CHOICES) under compile auto"]
    set_choice(monkeypatch, "train_compile", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    set_choice(monkeypatch, "store", None)
    assert lines() == ["  train compile     compile auto: timed in a long run's first steps (none stored yet)"]
    path = TRAIN_COMPILE.store_path()
    TRAIN_COMPILE.record(path, "a", {"choice": COMPILED, "eager_ms": 400.0, "compiled_ms": 250.0, "compile_s": 90.0})
    TRAIN_COMPILE.record(path, "b", {"choice": EAGER, "unusable": "RuntimeError: no compiler"})
    assert lines() == [
        "  train compile     compile auto, timed in a long run's first steps per key:",
        "    a: compiled (eager 400 ms, compiled 250 ms a step, 90 s to compile)",
        "    b: eager (compiling failed: RuntimeError: no compiler)",
    ]
