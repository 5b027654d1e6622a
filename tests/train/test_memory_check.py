"""A run that will not fit its device is refused before anything loads (`train.memory_check`, the same estimate
`plan` and `doctor` report); the FLOPs the time model prices against a count by hand; offline training lets the
target go once it has its embedding table and LM head."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.memory import StepShape
from dflashkit.train.memory_check import fit_problem, run_memory
from tests.helpers.process_cost import run_measured
from tests.helpers.published_configs import QWEN3_8B, write_config
from tests.helpers.train_runs import write_tokens_file


def _config(tmp_path: Path, target: Path, **kw) -> TrainConfig:
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 4)
    base = dict(target=str(target), tokens=str(tokens), online=True, out=str(tmp_path / "run"), progress=False)
    return TrainConfig(**{**base, **kw})


def test_a_run_that_does_not_fit_is_refused_naming_what_to_change(tmp_path) -> None:
    target = write_config(tmp_path / "qwen3-8b", QWEN3_8B)  # config only: nothing may be loaded
    cfg = _config(tmp_path, target)
    est = run_memory(cfg, device=torch.device("cpu"))
    assert est.parts["target weights"] == 8_190_735_360 * 4  # fp32 on a CPU, all of it online
    problem = fit_problem(cfg, available=int(est.peak * 0.5), device=torch.device("cpu"))
    assert problem is not None
    for lever in ("max_anchors (now 512)", "max_tokens (now 3072)", "online: false", "fsdp: true"):
        assert lever in problem
    assert fit_problem(cfg, available=int(est.peak * 1.2), device=torch.device("cpu")) is None


def test_the_closed_form_bound_refuses_far_runs_and_the_trace_decides_near_ones(tmp_path) -> None:
    """The lower bound (no drafter trace) never exceeds the traced estimate; a run past it is refused with "at
    least", one between the two with the traced "about" — the same number `plan` prints."""
    target = write_config(tmp_path / "qwen3-8b", QWEN3_8B)
    cfg = _config(tmp_path, target, max_anchors=2000, max_tokens=8192)
    cpu = torch.device("cpu")
    bound, est = run_memory(cfg, device=cpu, traced=False), run_memory(cfg, device=cpu)
    assert 0 < bound.peak < est.peak
    assert set(bound.parts) == set(est.parts) and bound.parts == est.parts  # only the activations differ
    far = fit_problem(cfg, available=int(bound.peak * 0.5), device=cpu)
    assert far is not None and f"needs at least {bound.peak / 2**30:,.1f} GiB" in far
    between = int((bound.peak + est.peak) / 2 / (1 - 0.1))  # HEADROOM: the usable share is 90 %
    near = fit_problem(cfg, available=between, device=cpu)
    assert near is not None and f"needs about {est.peak / 2**30:,.1f} GiB" in near
    offline = run_memory(_config(tmp_path, target, online=False), device=torch.device("cpu"))
    assert offline.parts["target weights"] == 2 * 151936 * 4096 * 4  # embedding table and LM head only


def test_train_refuses_before_loading_anything(tmp_path) -> None:
    """The CLI: a config that cannot fit this machine (the target alone is 33 GB in fp32) ends in one line, exit
    2, in seconds — the target's weights do not exist, so reaching a load would fail differently. However large
    the step (here 100,000 blocks of 16 queries over 65,536 tokens: 26,612 GiB), the estimate costs the same: the
    whole command in seconds and a few hundred MB, imports included (a trace at the step's own shape would take
    minutes and gigabytes). Its seconds are compared with the imports' alone, measured beside it: a machine's load
    slows both alike."""
    target = write_config(tmp_path / "qwen3-8b", QWEN3_8B)
    imports = run_measured([sys.executable, "-c", "import dflashkit.train.loop, transformers"], timeout=300)
    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 4)
    proc = run_measured(
        [sys.executable, "-m", "dflashkit", "train", "-", f"target={target}", f"tokens={tokens}", "online=true",
         f"out={tmp_path / 'run'}", "max_anchors=100000", "max_tokens=65536"],
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert (
        "train: this run needs at least" in line
        and "max_anchors (now 100000)" in line
        and "Traceback" not in proc.stderr
    )
    assert proc.seconds < 3 * imports.seconds + 10 and proc.peak_rss_mib < 800, (proc.seconds, imports.seconds)
    assert not (tmp_path / "run").exists()


def test_doctor_reports_the_training_memory(tmp_path) -> None:
    from dflashkit.diagnose.doctor import memory_finding

    target = write_config(tmp_path / "qwen3-8b", QWEN3_8B)
    yaml = tmp_path / "train.yaml"
    yaml.write_text(f"target: {target}\ntokens: {tmp_path / 'x.jsonl'}\nonline: true\n")
    with pytest.MonkeyPatch.context() as mp:  # the device's total memory decides: 128 GiB, then 8 GiB
        mp.setattr("dflashkit.train.memory_check.device_memory", lambda device, total=False: 128 * 2**30)
        ok = memory_finding(yaml)
        mp.setattr("dflashkit.train.memory_check.device_memory", lambda device, total=False: 8 * 2**30)
        fail = memory_finding(yaml)
    assert ok.status == "OK" and ok.check == "training memory" and "target weights 30.51" in ok.what
    assert "online features" in ok.what and "1 rank(s)" in ok.what
    assert fail.status == "FAIL" and "needs at least" in fail.what and "has 8.0 GiB available" in fail.what


def test_drafter_flops_equal_a_count_by_hand() -> None:
    """The FLOP counter over the drafter's linear layers against 2·m·n·k summed by hand, forward and backward
    (the backward of a frozen-input product: both gradients; of the fc over the features: the weight's only)."""
    from dflashkit.train.step_cost import drafter_flops

    cfg = DrafterConfig.for_target(
        hidden_size=64, vocab_size=97, num_target_layers=8, mask_token_id=3, num_hidden_layers=2, block_size=4
    )
    shape = StepShape(rows=1, tokens=40, blocks=5)
    t, nq, h = shape.tokens, shape.blocks * cfg.block_size, cfg.hidden_size
    q, kv, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    fc = 2 * t * cfg.num_features * h * h  # features (T, K·H) → (T, H)
    layer = 2 * (nq * h * q + (t + nq) * h * 2 * kv + nq * q * h + nq * h * 2 * inter + nq * inter * h)
    forward = fc + cfg.num_hidden_layers * layer
    # backward: weight gradients of every product + input gradients of all but fc (its input, the features, is data)
    backward = 2 * forward - fc
    assert drafter_flops(cfg, shape) == forward + backward


def test_offline_training_lets_the_target_go(tmp_path, tiny_llama_dir) -> None:
    """Offline, the run keeps the target's embedding table and LM head in memory of their own: nothing keeps the
    target's modules (or the file buffer its weights share) alive once setup is done."""
    from dflashkit.features.capture import CaptureSettings, capture
    from dflashkit.train.run import setup_run
    from tests.helpers.train_runs import cfg_for, make_samples

    target = Target.load(tiny_llama_dir)
    ids = DrafterConfig.for_target(hidden_size=64, vocab_size=97, num_target_layers=8, mask_token_id=3).target_layer_ids
    samples = make_samples(target, ids, n=3)
    capture(target, samples, tmp_path / "f", settings=CaptureSettings(layer_ids=tuple(ids), dtype="fp32"))
    del target, samples
    loaded: list[weakref.ref] = []
    real_load = Target.load.__func__

    def spy(cls, *a, **k):
        t = real_load(cls, *a, **k)
        loaded.append(weakref.ref(t.model))
        return t

    cfg = cfg_for(tmp_path / "run", target=str(tiny_llama_dir), features=str(tmp_path / "f"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Target, "load", classmethod(spy))
        run = setup_run(cfg)
    gc.collect()
    assert loaded and loaded[0]() is None
    assert run.embed.untyped_storage().nbytes() == run.embed.numel() * run.embed.element_size()
    run.close()


def test_bad_layout_values_are_refused() -> None:
    from dflashkit.diagnose.plan import Hardware

    with pytest.raises(ConfigError, match="expected N×NAME"):
        Hardware.parse("8xTPU")
    assert Hardware.parse("2xh200").count == 2 and Hardware.parse("H100").gpu_mem_gib == 79.6


def test_a_run_resumes_its_checkpoint_when_only_a_default_changed(tmp_path, tiny_llama_dir, monkeypatch) -> None:
    """A field the config leaves to dflashkit's defaults (the MLP width, whose default for large targets now follows
    the target) does not stop a run from resuming its own checkpoint; one that follows the target does."""
    import dflashkit.drafter.config as drafter_config
    from dflashkit.train.loop import train
    from tests.helpers.train_runs import cfg_for, make_samples

    target = Target.load(tiny_llama_dir)
    ids = DrafterConfig.for_target(hidden_size=64, vocab_size=97, num_target_layers=8, mask_token_id=3).target_layer_ids
    samples = make_samples(target, ids, n=4)
    train(cfg_for(tmp_path / "run", max_steps=3, save_every=2), dataset=samples, target=target)
    real = drafter_config.default_geometry

    def changed(hidden: int, target_intermediate: int | None = None) -> dict[str, int]:
        out = real(hidden, target_intermediate)
        return {**out, "intermediate_size": out["intermediate_size"] + 32}  # a later version's default

    monkeypatch.setattr(drafter_config, "default_geometry", changed)
    assert train(cfg_for(tmp_path / "run", max_steps=4, save_every=2), dataset=samples, target=target) is not None
    monkeypatch.setattr(DrafterConfig, "for_target", classmethod(_other_layers(DrafterConfig.for_target.__func__)))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        train(cfg_for(tmp_path / "run", max_steps=5, save_every=2), dataset=samples, target=target)


def _other_layers(for_target):
    def build(cls, **kw):
        cfg = for_target(cls, **kw)
        return cfg.replace(target_layer_ids=[i + 1 for i in cfg.target_layer_ids[:-1]] + [cfg.target_layer_ids[-1]])

    return build
