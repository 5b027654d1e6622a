"""`capture --compile auto` (features.capture_compile, target.compiled_layers): the trial's compiled batches are real
batches of the capture (the same files with a stand-in for torch.compile), a failing compile is run again eagerly
and recorded, a small capture never tries, the layers' own forward is back after the block — and one slow test
compiles the tiny target's layers for real and compares the features with eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.cpu_products.compile_choice import COMPILED, EAGER_STEPS, ROUNDS, WARM_STEPS
from dflashkit.features.capture_compile import CAPTURE_COMPILE, compile_key
from dflashkit.features.captured import CapturedFeatures
from dflashkit.target.compiled_layers import compiled_layers
from dflashkit.target.model import Target
from helpers.choices import set_choice
from helpers.fake_compile import fake_layer_compile
from tests.features.test_capture import LAYERS, make_samples, quiet

TRIAL_BATCHES = WARM_STEPS + EAGER_STEPS + 2 + 2 * ROUNDS


@pytest.fixture(scope="module")
def llama(tiny_target_dirs) -> Target:
    return Target.load(tiny_target_dirs["llama"])


@pytest.fixture
def fake_compile(llama: Target, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """(calls, set_fail): torch.compile replaced by a counting (or failing) stand-in; the store in tmp_path."""
    with fake_layer_compile(
        llama, monkeypatch, tmp_path / "store", "capture_compile", "BackendCompilerFailed: inductor\ndetail"
    ) as faked:
        yield faked


def _same_files(a: Path, b: Path, target: Target) -> None:
    for x, y in zip(CapturedFeatures(a, expect_target=target), CapturedFeatures(b, expect_target=target), strict=True):
        assert torch.equal(x.features, y.features) and torch.equal(x.target_tokens, y.target_tokens)


def test_a_measured_trial_captures_the_same_files_and_stores_its_verdict(
    llama: Target, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, _ = fake_compile
    samples = make_samples([20 + i for i in range(TRIAL_BATCHES + 3)])
    quiet(llama, samples, tmp_path / "eager", compile="off", precision="fp32")
    assert calls == []
    set_choice(monkeypatch, "capture_compile", "measure")
    logged: list[str] = []
    from dflashkit.features.capture import CaptureSettings, capture

    capture(llama, samples, tmp_path / "trial", settings=CaptureSettings(layer_ids=tuple(LAYERS), precision="fp32"),
            progress=False, log=logged.append)  # fmt: skip
    _same_files(tmp_path / "eager", tmp_path / "trial", llama)
    entry = CAPTURE_COMPILE.stored_choices()[compile_key(llama, "fp32")]
    compiled_batches = 2 + ROUNDS + (3 if entry["choice"] == COMPILED else 0)
    assert len(calls) == compiled_batches * llama.num_layers  # every layer of every compiled batch, no other
    assert any("capture: torch.compile:" in m and "per 1k tokens" in m and "(timed now)" in m for m in logged)


def test_a_failing_compile_reruns_the_batch_eagerly_and_is_recorded(
    llama: Target, tmp_path: Path, fake_compile, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, set_fail = fake_compile
    samples = make_samples([20 + i for i in range(WARM_STEPS + EAGER_STEPS + 3)])
    quiet(llama, samples, tmp_path / "eager", compile="off", precision="fp32")
    set_fail(True)
    set_choice(monkeypatch, "capture_compile", "measure")
    quiet(llama, samples, tmp_path / "failed", precision="fp32")
    _same_files(tmp_path / "eager", tmp_path / "failed", llama)
    assert len(calls) == 1  # the first compiled layer raised; nothing compiled after
    set_choice(monkeypatch, "capture_compile", None)
    entry = CAPTURE_COMPILE.stored_choices()[compile_key(llama, "fp32")]
    assert entry["unusable"] == "RuntimeError: BackendCompilerFailed: inductor"
    quiet(llama, samples, tmp_path / "later", precision="fp32")  # a later capture stays eager: nothing compiled
    assert len(calls) == 1


def test_a_small_auto_capture_never_compiles_and_the_layers_are_restored(
    llama: Target, tmp_path: Path, fake_compile
) -> None:
    calls, _ = fake_compile
    quiet(llama, make_samples([20] * (TRIAL_BATCHES + 2)), tmp_path / "a", precision="fp32")
    assert calls == [] and CAPTURE_COMPILE.stored_choices() == {}
    layer = llama.text_model.layers[0]
    with compiled_layers(llama):
        assert "forward" in layer.__dict__
    assert "forward" not in layer.__dict__  # the class's forward again


@pytest.mark.slow
def test_really_compiled_layers_capture_what_eager_layers_do(llama: Target, tmp_path: Path) -> None:
    samples = make_samples([33, 20, 47])
    ids = [s.input_ids[None] for s in samples]
    with torch.no_grad():
        want = [llama.forward(x, layer_ids=LAYERS, logits=True) for x in ids]
        with compiled_layers(llama):
            got = [llama.forward(x, layer_ids=LAYERS, logits=True) for x in ids]
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b.features, a.features, rtol=1e-4, atol=1e-5)
        assert torch.equal(b.logits.argmax(-1), a.logits.argmax(-1))
