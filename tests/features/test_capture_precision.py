"""The capture's precision (dflashkit.features.capture_precision): bf16 autocast only when measured faster by the
margin, the choice kept and forced like training's, a non-float32 target computing in its own dtype, the manifest
recording the precision and a resumed capture keeping it — with injected timings — and bf16-autocast features within
bf16's rounding of the fp32 target's, with labels from float32 logits, on a tiny target and on the embedded SmolLM2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflashkit.cpu_products.choice import BF16_GATE as MARGIN
from dflashkit.cpu_products.choice import PRECISIONS
from dflashkit.errors import ConfigError, DataError
from dflashkit.features import capture_precision as cp
from dflashkit.features.captured import CapturedFeatures
from dflashkit.features.manifest import MANIFEST_NAME, Manifest
from dflashkit.target.model import Target
from helpers.choices import set_choice
from tests.features.test_capture import LAYERS, make_samples, quiet


@pytest.fixture(scope="module")
def llama(tiny_target_dirs) -> Target:
    return Target.load(tiny_target_dirs["llama"])


def _lengths(samples) -> list[int]:
    return [len(s) for s in samples]


def _timer(fp32: float, bf16: float, calls: list[tuple[int, bool]]):
    def timer(target, tokens: int, is_bf16: bool) -> float:
        calls.append((tokens, is_bf16))
        return bf16 if is_bf16 else fp32

    return timer


def test_timed_length_is_the_median_rounded_up_to_a_power_of_two_within_bounds() -> None:
    assert cp.timed_length([100, 300, 330, 900]) == 512  # median 330
    assert cp.timed_length([5, 6, 7]) == cp.MIN_TOKENS
    assert cp.timed_length([100_000]) == cp.MAX_TOKENS
    assert cp.timed_length([256]) == 256 and cp.timed_length([257]) == 512
    assert cp.timed_length([]) == cp.MIN_TOKENS


def test_bf16_only_when_faster_by_the_margin_and_the_choice_is_kept(
    llama: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_choice(monkeypatch, "capture_precision", None)
    set_choice(monkeypatch, "store", None)  # the store is on (the suite turns it off) …
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))  # … in this test's own cache
    samples, calls = make_samples([100, 120, 90]), []
    close = _timer(0.010, 0.010 / (MARGIN - 0.05), calls)  # bf16 faster, but by less than the margin
    assert cp.capture_precision(llama, _lengths(samples), timer=close)[0] == "fp32"
    assert calls == [(128, False), (128, True)]  # timed at the median length rounded up
    longer = make_samples([600, 700, 650])  # another length: timed on its own
    choice, ms = cp.capture_precision(llama, _lengths(longer), timer=_timer(0.030, 0.010, calls))
    assert (choice, ms) == ("bf16", {"fp32": 30.0, "bf16": 10.0})
    stored = cp.CAPTURE.store().read(cp.CAPTURE.usable_entry(PRECISIONS))
    assert stored[cp.choice_key(llama, 128)]["choice"] == "fp32"
    assert stored[cp.choice_key(llama, 1024)]["choice"] == "bf16"

    def never(*a) -> float:
        raise AssertionError("a stored choice is not timed again")

    assert cp.capture_precision(llama, _lengths(longer), timer=never) == ("bf16", {})
    set_choice(monkeypatch, "capture_precision", "fp32")  # the environment replaces the measurement
    assert cp.capture_precision(llama, _lengths(longer), timer=never) == ("fp32", {})
    set_choice(monkeypatch, "capture_precision", "half")
    with pytest.raises(ConfigError, match="DFLASHKIT_CHOICES: capture_precision='half': expected one of fp32, bf16"):
        cp.capture_precision(llama, _lengths(longer), timer=never)


def test_info_lists_the_capture_choices(llama: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflashkit.diagnose.info import _machine_lines, _measured_precision

    set_choice(monkeypatch, "capture_precision", None)
    set_choice(monkeypatch, "store", None)
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    cp.capture_precision(llama, [300], timer=_timer(0.9, 0.3, []))

    def lines() -> list[str]:
        base = {"flags": [], "products_by_rows": {}, "products_mode": "auto", "cpu": "x", "threads": 1, "blas": "b"}
        chosen = _measured_precision("capture", cp.CAPTURE)
        found = _machine_lines({**base, "torch": "t", "products_store": None, **chosen})
        start = next(i for i, line in enumerate(found) if line.startswith("  capture (CPU)"))
        end = next(i for i, line in enumerate(found) if line.startswith("  train compile"))
        return found[start:end]

    assert lines() == [
        "  capture (CPU)     precision auto, timed per target and sequence length:",
        f"    {cp.choice_key(llama, 512)}: bf16 (fp32 900 ms, bf16 300 ms a forward)",
    ]
    set_choice(monkeypatch, "capture_precision", "fp32")
    assert lines() == ["  capture (CPU)     capture_precision=fp32 (DFLASHKIT_CHOICES) for every run"]


def test_explicit_precisions_a_target_in_its_own_dtype_and_a_gpu(
    llama: Target, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = make_samples([10])

    def never(*a) -> float:
        raise AssertionError("not timed")

    assert cp.capture_precision(llama, _lengths(samples), "bf16", timer=never) == ("bf16", {})
    assert cp.capture_precision(llama, _lengths(samples), "fp32", timer=never) == ("fp32", {})
    with pytest.raises(ConfigError, match="capture precision 'fp8': expected one of auto, fp32, bf16"):
        cp.capture_precision(llama, [10], "fp8")
    with pytest.raises(ConfigError, match="begun with the target loaded in bf16; load it that way to resume it"):
        cp.capture_precision(llama, [10], "bf16-weights")
    half = Target.load(tiny_llama_dir, dtype=torch.bfloat16)  # computes in bf16 whatever is asked, recorded apart
    for asked in ("auto", "bf16", "bf16-weights"):
        assert cp.capture_precision(half, _lengths(samples), asked, timer=never) == ("bf16-weights", {})
    with pytest.raises(ConfigError, match="loaded in bf16 and computes in it; load it in float32 to capture in fp32"):
        cp.capture_precision(half, [10], "fp32")
    gpu = SimpleNamespace(dtype=torch.float32, device=torch.device("cuda"))  # a float32 target on a GPU: bf16, untimed
    assert cp.capture_precision(gpu, [10], "auto", timer=never) == ("fp32", {})  # the suite's environment says fp32
    set_choice(monkeypatch, "capture_precision", None)
    assert cp.capture_precision(gpu, [10], "auto", timer=never) == ("bf16", {})


def test_bf16_features_within_bf16_rounding_and_labels_from_float32_logits(llama: Target, tmp_path: Path) -> None:
    samples = make_samples([33, 20, 47])
    quiet(llama, samples, tmp_path / "fp32", dtype="fp32", precision="fp32")
    m = quiet(llama, samples, tmp_path / "bf16", dtype="fp32", precision="bf16")
    assert m.precision == "bf16" and json.loads((tmp_path / "bf16" / MANIFEST_NAME).read_text())["precision"] == "bf16"
    ref = CapturedFeatures(tmp_path / "fp32", expect_target=llama, expect_layer_ids=LAYERS)
    got = CapturedFeatures(tmp_path / "bf16", expect_target=llama, expect_layer_ids=LAYERS)
    h = llama.hidden_size
    for s, a, b in zip(samples, ref, got, strict=True):
        for k in range(len(LAYERS)):  # per layer: relative error of a few bf16 roundings (2^-8 each)
            x, y = a.features[:, k * h : (k + 1) * h], b.features[:, k * h : (k + 1) * h]
            rel = ((y - x).norm() / x.norm()).item()
            assert 0 < rel < 3e-2, (s.id, LAYERS[k], rel)
        out = cp.capture_forward(llama, s.input_ids[None], "bf16", layer_ids=[], logits=True)
        assert out.logits.dtype == torch.float32  # the labels' logits are never formed in bf16
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = llama.forward(s.input_ids[None], layer_ids=[], logits=False)
        want = llama.verifier_logits(out.final_hidden.float())[0].argmax(-1)  # float32 logits of the bf16 body
        assert torch.equal(b.target_tokens, want)
        assert (b.target_tokens == a.target_tokens).float().mean() >= 0.9


def test_the_manifest_records_the_precision_and_a_resume_keeps_it(
    llama: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = make_samples([9, 12, 7])
    set_choice(monkeypatch, "capture_precision", "bf16")
    whole = quiet(llama, samples, tmp_path / "whole", dtype="fp32", shard_max_tokens=10)
    part = quiet(llama, samples, tmp_path / "part", dtype="fp32", shard_max_tokens=10)
    assert whole.precision == part.precision == "bf16" and len(part.shards) == 3
    manifest = Manifest.load(tmp_path / "part")
    manifest.shards[-1]["done"] = False  # as if killed before the last shard
    manifest.save(tmp_path / "part")
    (tmp_path / "part" / manifest.shards[-1]["file"]).unlink()
    # this machine would now choose fp32: the capture still finishes in bf16
    set_choice(monkeypatch, "capture_precision", "fp32")
    assert quiet(llama, samples, tmp_path / "part", dtype="fp32", shard_max_tokens=10).precision == "bf16"
    last = manifest.shards[-1]["file"]
    assert (tmp_path / "part" / last).read_bytes() == (tmp_path / "whole" / last).read_bytes()
    with pytest.raises(DataError, match="already holds a capture with precision 'bf16' but this run has 'fp32'"):
        quiet(llama, samples, tmp_path / "part", dtype="fp32", shard_max_tokens=10, precision="fp32")


def test_a_capture_older_than_the_field_resumes_as_the_target_is_loaded(
    llama: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = make_samples([9, 12, 7])
    quiet(llama, samples, tmp_path, dtype="fp32", shard_max_tokens=10, precision="fp32")
    manifest = Manifest.load(tmp_path)
    manifest.shards[-1]["done"] = False  # killed before its last shard …
    manifest.save(tmp_path)
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    del raw["precision"]  # … by a dflashkit that did not record the precision
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    assert Manifest.load(tmp_path).precision is None
    with pytest.raises(DataError, match="already holds a capture with precision 'fp32' but this run has 'bf16'"):
        quiet(llama, samples, tmp_path, dtype="fp32", shard_max_tokens=10, precision="bf16")
    # this machine would choose bf16 now: the capture still finishes as it began
    set_choice(monkeypatch, "capture_precision", "bf16")
    assert quiet(llama, samples, tmp_path, dtype="fp32", shard_max_tokens=10).precision == "fp32"
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert raw["precision"] == "fp32" and all(sh["done"] for sh in raw["shards"])
    raw["precision"] = "int8"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(DataError, match="precision"):
        Manifest.load(tmp_path)


def test_a_capture_begun_with_a_half_target_resumes_only_so(
    llama: Target, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    half = Target.load(tiny_llama_dir, dtype=torch.bfloat16)
    samples = make_samples([9, 12, 7])
    assert quiet(half, samples, tmp_path, dtype="bf16", shard_max_tokens=10).precision == "bf16-weights"
    manifest = Manifest.load(tmp_path)
    manifest.shards[-1]["done"] = False
    manifest.save(tmp_path)
    with pytest.raises(ConfigError, match="begun with the target loaded in bf16; load it that way to resume it"):
        quiet(llama, samples, tmp_path, dtype="bf16", shard_max_tokens=10)  # the float32 target: refused
    assert quiet(half, samples, tmp_path, dtype="bf16", shard_max_tokens=10).precision == "bf16-weights"


def test_one_real_timing_of_each_precision(llama: Target) -> None:
    for bf16 in (False, True):
        seconds = cp.time_target_forward(llama, 64, bf16, rounds=1)
        assert 0 < seconds < 60


@pytest.mark.integration
def test_embedded_smollm2_bf16_features_stay_within_bf16_rounding() -> None:
    """On the real target: each captured layer's bf16-autocast output within 2.5 % (relative norm) of fp32's —
    a few roundings of bf16's 2^-8 — and the labels equal on ≥ 95 % of positions."""
    target = Target.load("default")
    ids = torch.randint(0, target.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    layers = [1, 8, 14, 20, 27]
    ref = cp.capture_forward(target, ids, "fp32", layer_ids=layers, logits=True)
    got = cp.capture_forward(target, ids, "bf16", layer_ids=layers, logits=True)
    assert got.logits.dtype == torch.float32
    h = target.hidden_size
    for k, layer in enumerate(layers):
        x, y = ref.features[..., k * h : (k + 1) * h], got.features[..., k * h : (k + 1) * h]
        rel = ((y - x).norm() / x.norm()).item()
        assert rel < 2.5e-2, (layer, rel)
    agree = (ref.logits.argmax(-1) == got.logits.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree
