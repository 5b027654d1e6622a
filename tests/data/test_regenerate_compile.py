"""`prepare --compile auto` for in-process regeneration (data.regenerate_compile): the trial's compiled batches are
real batches (the same lines with a stand-in for torch.compile), a failing compile runs the batch again eagerly and
is recorded, a small regeneration never tries; and one slow test runs the trial with torch.compile itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashkit.cpu_products.compile_choice import COMPILED, EAGER_STEPS, ROUNDS, WARM_STEPS
from dflashkit.data.conversations import Conversation
from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate
from dflashkit.data.regenerate_compile import REGENERATE_COMPILE, compile_key
from helpers.choices import set_choice
from helpers.fake_compile import fake_layer_compile

BATCHES = WARM_STEPS + EAGER_STEPS + 2 + 2 * ROUNDS + 2
SETTINGS = dict(max_new_tokens=5, batch_size=1)


def _convs(n: int) -> list[Conversation]:
    turns = [
        [{"role": "user", "content": f"Question {i}: why?"}, {"role": "assistant", "content": "x"}] for i in range(n)
    ]
    return [Conversation(messages, f"c{i}", "test") for i, messages in enumerate(turns)]


def _lines(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "generation"} for r in read_regenerated(path)]


@pytest.fixture
def fake_compile(tiny, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """(calls, set_fail): torch.compile replaced by a counting (or failing) stand-in; the store in tmp_path."""
    with fake_layer_compile(
        tiny, monkeypatch, tmp_path / "store", "regenerate_compile", "Unsupported: data-dependent branch\ndetail"
    ) as faked:
        yield faked


def test_a_measured_trial_writes_the_same_lines_and_stores_its_verdict(
    tiny, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    calls, _ = fake_compile
    convs = _convs(BATCHES)
    regenerate(tiny, convs, tmp_path / "eager.jsonl", progress=False, settings=RegenSettings(**SETTINGS, compile="off"))
    assert calls == []
    set_choice(monkeypatch, "regenerate_compile", "measure")
    regenerate(tiny, convs, tmp_path / "trial.jsonl", progress=False, settings=RegenSettings(**SETTINGS))
    assert _lines(tmp_path / "trial.jsonl") == _lines(tmp_path / "eager.jsonl")
    entry = REGENERATE_COMPILE.stored_choices()[compile_key(tiny, 1)]
    assert entry["eager_ms"] > 0 and calls  # the compiled batches ran through the stand-in
    assert "regenerate: torch.compile:" in capsys.readouterr().out
    if entry["choice"] == COMPILED:
        assert len(calls) > (2 + ROUNDS) * tiny.num_layers


def test_a_failing_compile_reruns_the_batch_eagerly_and_is_recorded(
    tiny, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, set_fail = fake_compile
    convs = _convs(WARM_STEPS + EAGER_STEPS + 2)
    regenerate(tiny, convs, tmp_path / "eager.jsonl", progress=False, settings=RegenSettings(**SETTINGS, compile="off"))
    set_fail(True)
    set_choice(monkeypatch, "regenerate_compile", "measure")
    regenerate(tiny, convs, tmp_path / "failed.jsonl", progress=False, settings=RegenSettings(**SETTINGS))
    assert _lines(tmp_path / "failed.jsonl") == _lines(tmp_path / "eager.jsonl") and len(calls) == 1
    set_choice(monkeypatch, "regenerate_compile", None)
    entry = REGENERATE_COMPILE.stored_choices()[compile_key(tiny, 1)]
    assert entry["unusable"] == "RuntimeError: Unsupported: data-dependent branch"


def test_a_small_auto_regeneration_never_compiles(tiny, tmp_path: Path, fake_compile) -> None:
    calls, _ = fake_compile
    regenerate(tiny, _convs(BATCHES), tmp_path / "a.jsonl", progress=False, settings=RegenSettings(**SETTINGS))
    assert calls == [] and REGENERATE_COMPILE.stored_choices() == {}


@pytest.mark.slow
def test_really_compiled_regeneration_writes_the_eager_lines(
    tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.compile itself: whether inductor compiles the decoding layers (here its lowering of a stacked product
    with dynamic shapes can fail) or not, the greedy lines are the eager ones and the verdict is stored."""
    tiny.__dict__.pop("_compiled_layer_forwards", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "store"))
    set_choice(monkeypatch, "store", None)
    convs = _convs(WARM_STEPS + EAGER_STEPS + 2 + 2 * ROUNDS)
    regenerate(tiny, convs, tmp_path / "eager.jsonl", progress=False, settings=RegenSettings(**SETTINGS, compile="off"))
    set_choice(monkeypatch, "regenerate_compile", "measure")
    regenerate(tiny, convs, tmp_path / "real.jsonl", progress=False, settings=RegenSettings(**SETTINGS))
    tiny.__dict__.pop("_compiled_layer_forwards", None)
    assert _lines(tmp_path / "real.jsonl") == _lines(tmp_path / "eager.jsonl")
    set_choice(monkeypatch, "regenerate_compile", None)
    assert compile_key(tiny, 1) in REGENERATE_COMPILE.stored_choices()


def test_a_stored_compiled_trial_is_used_from_the_first_batch(tiny, tmp_path: Path, fake_compile) -> None:
    """Before any batch the work left is estimated from the settings (a reply of max_new_tokens a conversation)."""
    calls, _ = fake_compile
    entry = {"choice": COMPILED, "eager_ms": 4000.0, "compiled_ms": 1000.0, "compile_s": 0.01}
    REGENERATE_COMPILE.record(REGENERATE_COMPILE.store_path(), compile_key(tiny, 1), entry)
    regenerate(tiny, _convs(2), tmp_path / "a.jsonl", progress=False, settings=RegenSettings(**SETTINGS))
    assert len(calls) >= 2 * tiny.num_layers  # both batches through the compiled layers
