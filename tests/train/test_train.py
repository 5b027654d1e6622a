"""Tests of dflashkit.train.loop and its config/state: the design.md §3 guards (all K layers feed fc, labels from the
final layer at the right index, noise only on fc inputs, an overfit run that drafts its sequence through the
inference path), exact resume, resume-compatibility errors, config parsing, metrics (how a run stops:
test_train_stops.py).

The feature source is built here: a list of Samples whose features come from a tiny target's `Target.forward`.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dflashkit.cli import main
from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.blocks import build_blocks
from dflashkit.train.config import CPU_SIZED, TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.metrics import RollingStats, read_metrics
from dflashkit.train.packing import collate_rows, pack_row
from dflashkit.train.slot_targets import block_labels
from dflashkit.train.state import latest_checkpoint
from dflashkit.train.step import StepDraw, noise_std_at, prepare_inputs, row_anchors
from helpers.train_runs import DRAFTER, cfg_for, final_weights, make_samples, write_tokens_file
from helpers.weights_close import assert_close_after_adam, assert_grads_close

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def samples(target: Target) -> list[Sample]:
    return make_samples(target, default_drafter_config(target, **DRAFTER).target_layer_ids)


# ---------------------------------------------------------------------------------------------- §3 guards
def test_fc_consumes_all_target_layers(target: Target) -> None:
    cfg = default_drafter_config(target, **DRAFTER)
    assert cfg.num_features == 5 and len(set(cfg.target_layer_ids)) == 5
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    h = cfg.hidden_size
    assert drafter.fc.in_features == 5 * h
    feats = make_samples(target, cfg.target_layer_ids, n=1)[0].features[None]  # (1, T, 5·H)
    assert feats.shape[-1] == 5 * h
    t = feats.shape[1]
    embeds = drafter.block_embeddings(torch.tensor([[5]]), target.embed_weight, cfg.block_size)
    kw = dict(context_positions=torch.arange(t)[None], block_positions=torch.arange(t, t + cfg.block_size)[None])
    with torch.no_grad():
        ref = drafter(feats, embeds, **kw)
        for j in range(5):
            cut = feats.clone()
            cut[..., j * h : (j + 1) * h] = 0  # drop target layer j
            assert (drafter(cut, embeds, **kw) - ref).abs().max() > 1e-4, f"fc ignores target layer {j}"


def test_labels_same_position_data_and_final_layer_target(target: Target, samples: list[Sample]) -> None:
    """Slot k of the anchor-a block: data label input_ids[a+k]; target label = argmax of the target's final-layer
    logits at index a+k−1 (its prediction for the token at a+k)."""
    two = [samples[0], samples[1]]
    rows = collate_rows([pack_row(two, 64)], [0])
    anchors = row_anchors(rows, seed=0, epoch=0, max_anchors=512)
    blocks = build_blocks(rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask, block_size=4, anchors=anchors)
    data, tgt = block_labels(blocks, rows, "data"), block_labels(blocks, rows, "target")
    logits = [target.forward(s.input_ids[None]).logits[0] for s in two]  # final norm + LM head
    offset = [0, len(two[0])]
    checked = 0
    for n, a in enumerate(blocks.anchors[0].tolist()):
        d = int(rows.doc_ids[0, a])
        local = a - offset[d]
        for k in range(1, 4):
            if local + k >= len(two[d]):
                assert data[0, n, k] == -100 and tgt[0, n, k] == -100  # never crosses a document
                continue
            assert data[0, n, k] == two[d].input_ids[local + k]
            assert tgt[0, n, k] == logits[d][local + k - 1].argmax()
            checked += 1
    assert checked > 20


def test_noise_only_on_fc_inputs(target: Target, samples: list[Sample]) -> None:
    cfg = default_drafter_config(target, **DRAFTER)
    rows = collate_rows([pack_row(samples[:2], 64), pack_row(samples[2:3], 64)], [0, 1])
    kw = dict(max_anchors=512, seed=0, epoch=1, step=3)
    for labels in ("data", "target"):
        clean = prepare_inputs(rows, cfg, StepDraw(labels, noise_std=0.0, **kw))
        noisy = prepare_inputs(rows, cfg, StepDraw(labels, noise_std=0.5, **kw))
        assert torch.equal(clean.labels, noisy.labels)
        assert torch.equal(clean.blocks.first_tokens, noisy.blocks.first_tokens)
        real = rows.doc_ids >= 0
        assert not torch.equal(clean.features[real], noisy.features[real])
        assert torch.equal(clean.features[~real], noisy.features[~real])  # padding stays zero
        assert torch.equal(clean.features, rows.features)  # inputs untouched
    c = TrainConfig(noise_std=0.2, noise_schedule="cosine")
    assert noise_std_at(c, 0, 10) == pytest.approx(0.2) and noise_std_at(c, 10, 10) == pytest.approx(0.0)


def test_overfit_one_sequence_drafts_it_through_inference_path(tmp_path: Path, target: Target) -> None:
    cfg_d = default_drafter_config(target, **DRAFTER)
    seq = make_samples(target, cfg_d.target_layer_ids, n=1, lengths=[24], prompt=0, seed=5)
    result = train(
        cfg_for(tmp_path / "run", max_steps=150, lr=3e-3, warmup_ratio=0.02, save_every=0), dataset=seq, target=target
    )
    assert result.stopped == "completed" and result.train_metrics["loss"] < 0.1
    drafter = load_drafter(tmp_path / "run" / "final").eval()
    ids, feats, bs = seq[0].input_ids, seq[0].features, cfg_d.block_size
    with torch.no_grad():
        for a in range(0, len(ids) - bs + 1):
            embeds = drafter.block_embeddings(ids[a][None, None], target.embed_weight, bs)  # [tok, MASK…]
            hidden = drafter(
                feats[None, :a],
                embeds,
                context_positions=torch.arange(a)[None],
                block_positions=torch.arange(a, a + bs)[None],
                attention_mask=None,
            )
            draft = drafter.logits(hidden, target.lm_head_weight).argmax(-1)[0]  # (bs,)
            assert draft[1:].tolist() == ids[a + 1 : a + bs].tolist(), f"anchor {a}"


# ---------------------------------------------------------------------------------------------- resume and stops
def test_exact_resume_matches_uninterrupted(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    kw = dict(noise_std=0.05, val_samples=1, eval_every=2)
    straight = train(cfg_for(tmp_path / "a", **kw), dataset=samples, target=target)
    assert straight.step == 6

    def kill(end) -> None:
        if end.step == 3:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(cfg_for(tmp_path / "b", **kw), dataset=samples, target=target, callbacks=[kill])
    assert latest_checkpoint(tmp_path / "b").name == "step-000003"
    resumed = train(cfg_for(tmp_path / "b", **kw), dataset=samples, target=target)
    assert resumed.step == 6
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    la = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["split"] == "train"]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["split"] == "train"]
    assert len(lb) == 6 and la == pytest.approx(lb, abs=1e-6)


def _first_step_grads(cfg: TrainConfig, samples: list[Sample], target: Target) -> list[torch.Tensor]:
    """Train `cfg`; return the gradients the optimizer saw at its first step."""
    grads: list[torch.Tensor] = []

    def keep(opt, args, kwargs) -> None:
        if not grads:
            grads.extend(p.grad.detach().clone() for g in opt.param_groups for p in g["params"] if p.grad is not None)

    handle = register_optimizer_step_pre_hook(keep)
    try:
        train(cfg, dataset=samples, target=target)
    finally:
        handle.remove()
    return grads


def test_grad_accum_equals_bigger_batch(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    """2 rows in one batch vs 2 accumulated rows of 1: the same loss and gradient at the same weights (up to
    float32 summation order), hence weights that agree as far as Adam allows (tests/helpers/weights_close.py)."""
    ga = _first_step_grads(cfg_for(tmp_path / "a", batch_rows=2, max_steps=3), samples, target)
    gb = _first_step_grads(cfg_for(tmp_path / "b", batch_rows=1, grad_accum=2, max_steps=3), samples, target)
    assert len(ga) == len(list(DFlashDrafter(default_drafter_config(target, **DRAFTER)).parameters()))
    assert_grads_close(ga, gb)
    la, lb = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert la[0]["loss"] == pytest.approx(lb[0]["loss"], rel=1e-5)  # step 1: same weights, same loss
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-3)
    assert_close_after_adam(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"), lr=2e-3, steps=3)


def test_data_workers_give_the_same_run(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    train(cfg_for(tmp_path / "a", max_steps=3, batch_rows=2), dataset=samples, target=target)
    train(cfg_for(tmp_path / "b", max_steps=3, batch_rows=2, num_workers=1), dataset=samples, target=target)
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_incompatible_config(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    train(cfg_for(tmp_path, max_steps=2, save_every=0), dataset=samples, target=target)
    with pytest.raises(ConfigError, match=r"drafter\.block_size was 4 .* is 8"):
        train(cfg_for(tmp_path, max_steps=4, drafter={**DRAFTER, "block_size": 8}), dataset=samples, target=target)
    with pytest.raises(ConfigError, match="lr was"):
        train(cfg_for(tmp_path, max_steps=4, lr=1e-3), dataset=samples, target=target)
    more = train(cfg_for(tmp_path, max_steps=4), dataset=samples, target=target)  # run length may change
    assert more.step == 4
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert lrs[3] > 0  # the new cosine, not the end (lr 0) of the old 2-step schedule


def test_time_schedule_spans_training_time_and_resumes(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    """schedule_minutes: the lr follows warmup + cosine over summed step times (not steps); the run completes
    once they are spent, also across a resume, and max_steps still caps it."""
    from dflashkit.train.schedule import cosine_at

    seconds = 1.5
    kw = dict(max_steps=None, epochs=1, schedule_minutes=seconds / 60, warmup_ratio=0.1, save_every=0)

    def stop_at_3(end) -> None:
        if end.step == 3:
            signal.raise_signal(signal.SIGINT)

    first = train(cfg_for(tmp_path, **kw), dataset=samples, target=target, callbacks=[stop_at_3])
    assert first.stopped == "interrupted" and first.step == 3
    done = train(cfg_for(tmp_path, **kw), dataset=samples, target=target)  # resumes the same schedule
    assert done.stopped == "completed" and done.step > 3 and done.final_dir is not None
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["split"] == "train"]
    assert [r["step"] for r in rows] == list(range(1, done.step + 1))
    elapsed = 0.0
    for r in rows:  # lr of each step = cosine at the training time before it
        assert r["lr"] == pytest.approx(2e-3 * cosine_at(elapsed / seconds, 0.1), rel=1e-9, abs=1e-15)
        elapsed += r["step_s"]
    assert elapsed >= seconds > elapsed - rows[-1]["step_s"]  # stopped by the first step past the schedule
    lrs = [r["lr"] for r in rows]
    peak = lrs.index(max(lrs))
    assert all(a >= b for a, b in pairwise(lrs[peak:]))  # cosine: never rises after the peak
    assert cosine_at(0.0, 0.1) == pytest.approx(0.01) and cosine_at(1.0, 0.1) == 0.0
    capped = train(cfg_for(tmp_path / "cap", **{**kw, "max_steps": 2}), dataset=samples, target=target)
    assert capped.stopped == "completed" and capped.step == 2
    with pytest.raises(ConfigError, match=r"t.yaml: schedule_minutes = 0: expected a finite number > 0"):
        TrainConfig.from_dict({"schedule_minutes": 0}, source="t.yaml")


# ---------------------------------------------------------------------------------------------- objectives, metrics
def test_target_labels_and_kl_train(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    r1 = train(cfg_for(tmp_path / "t", labels="target", max_steps=2), dataset=samples, target=target)
    r2 = train(cfg_for(tmp_path / "k", loss="kl", labels="target", max_steps=2), dataset=samples, target=target)
    assert r1.step == r2.step == 2
    assert all(0 < r["loss"] < 50 for r in read_metrics(tmp_path / "k" / "metrics.jsonl"))


@pytest.mark.parametrize("loss", ["tv", "nla", "lk_hybrid"])
def test_acceptance_losses_train(loss: str, tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    """The acceptance-rate objectives run through a real training step (the target's distribution per slot)."""
    result = train(cfg_for(tmp_path / loss, loss=loss, labels="target", max_steps=3), dataset=samples, target=target)
    losses = [r["loss"] for r in read_metrics(tmp_path / loss / "metrics.jsonl") if r["split"] == "train"]
    bound = 1.0 if loss == "tv" else 50.0  # a TV distance lies in [0, 1]
    assert result.step == 3 and all(0 <= x <= bound and math.isfinite(x) for x in losses)


def test_bf16_autocast_path_runs(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    """The CUDA default (bf16 autocast, masks in bf16), exercised on CPU; weights stay fp32."""
    result = train(cfg_for(tmp_path, dtype="bf16", max_steps=2), dataset=samples, target=target)
    assert result.step == 2 and 0 < result.train_metrics["loss"] < 20
    assert all(v.dtype == torch.float32 for v in final_weights(tmp_path).values())


def test_metrics_files_and_loss_decreases(tmp_path: Path, target: Target, samples: list[Sample]) -> None:
    result = train(
        cfg_for(
            tmp_path, max_steps=12, save_every=5, eval_every=4, val_samples=1, tensorboard=True, keep_checkpoints=2
        ),
        dataset=samples,
        target=target,
    )
    recs = read_metrics(tmp_path / "metrics.jsonl")
    tr = [r for r in recs if r["split"] == "train"]
    va = [r for r in recs if r["split"] == "val"]
    assert [r["step"] for r in tr] == list(range(1, 13)) and [r["step"] for r in va] == [4, 8, 12]
    for key in (
        "loss",
        "accuracy",
        "tau",
        "lr",
        "grad_norm",
        "clipped",
        "clip_fraction",
        "tokens_per_s",
        "block_positions_per_s",
        "noise_std",
        "loss_p10",
        "loss_median",
        "loss_mean",
        "loss_p90",
    ):
        assert key in tr[-1], key
    assert len(tr[-1]["accuracy"]) == 4 and tr[-1]["loss"] < tr[0]["loss"]
    assert {"loss", "accuracy", "tau"} <= set(va[0])
    assert any((tmp_path / "tb").iterdir())
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step-000010", "step-000012"]  # pruned to keep_checkpoints
    assert (tmp_path / "latest").read_text().strip() == "checkpoints/step-000012"
    saved = tmp_path / "checkpoints" / "step-000012"
    assert {p.name for p in saved.iterdir()} == {
        "config.json",
        "model.safetensors",
        "train_state.pt",
        "train_config.yaml",
    }
    state = torch.load(saved / "train_state.pt", weights_only=True)
    assert state["state"]["step"] == 12 and "optimizer" in state and "rng" in state
    assert result.val_metrics is not None


def test_rolling_stats() -> None:
    r = RollingStats(window=3)
    for v in (10.0, 1.0, 2.0, 3.0, float("nan")):
        r.add(v)
    s = r.summary()
    assert s["loss_median"] == 2.0 and s["loss_mean"] == 2.0 and s["loss_p10"] == pytest.approx(1.2)


# ---------------------------------------------------------------------------------------------- config
def test_train_config_yaml_overrides_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("features: feats\nlr: 1.0e-3\ndrafter:\n  num_hidden_layers: 2\n")
    cfg = TrainConfig.load(path, ["drafter.block_size=8", "epochs=2", "gamma=null", "noise_std=5e-2"])
    assert cfg.lr == 1e-3 and cfg.noise_std == 0.05 and cfg.epochs == 2
    assert cfg.drafter == {"num_hidden_layers": 2, "block_size": 8}
    assert TrainConfig.from_dict(yaml_roundtrip(cfg)) == cfg
    with pytest.raises(ConfigError, match=r"override 'lrr=1': unknown training option 'lrr'; valid: .*\blr\b"):
        TrainConfig.load(path, ["lrr=1"])
    with pytest.raises(ConfigError, match="loss"):
        TrainConfig.load(path, ["loss=mse"])
    with pytest.raises(ConfigError, match="online"):
        TrainConfig.load(None, ["tokens=t.jsonl"])
    with pytest.raises(ConfigError, match="batch_rows"):
        TrainConfig.load(path, ["batch_rows=0"])


def test_a_cpu_run_with_the_gpu_sized_geometry_gets_a_note() -> None:
    import yaml

    note = TrainConfig.load(None, ["features=f"]).cpu_sizing_note(cuda_available=False)
    assert note is not None and "max_tokens 3072, max_anchors 512" in note and "configs/smollm2.yaml" in note
    assert TrainConfig.load(None, ["features=f"]).cpu_sizing_note(cuda_available=True) is None
    assert TrainConfig.load(None, ["features=f", "drafter_device=cpu"]).cpu_sizing_note(cuda_available=True)
    on_gpu = dataclasses.replace(TrainConfig.load(None, ["features=f"]), drafter_device="cuda:0")  # not validated
    assert on_gpu.cpu_sizing_note(cuda_available=False) is None
    # one of the two chosen: the note names the other only; both chosen (even at the defaults): no note
    one = TrainConfig.load(None, ["features=f", "max_tokens=1024"]).cpu_sizing_note(cuda_available=False)
    assert one is not None and "default max_anchors 512" in one and "max_tokens 1024" not in one
    both = TrainConfig.load(None, ["features=f", "max_tokens=3072", "max_anchors=512"])
    assert both.cpu_sizing_note(cuda_available=False) is None
    # the CPU config needs no note, and the note's advice is what that file says
    config = Path(__file__).parents[2] / "configs" / "smollm2.yaml"
    assert TrainConfig.load(config).cpu_sizing_note(cuda_available=False) is None
    raw = yaml.safe_load(config.read_text())
    assert {n: raw[n] for n in CPU_SIZED} == CPU_SIZED


def yaml_roundtrip(cfg: TrainConfig) -> dict:
    import yaml

    return yaml.safe_load(cfg.to_yaml())


def test_cli_train_runs_with_online_features(tmp_path: Path, tiny_llama_dir: Path, capsys) -> None:

    tokens = write_tokens_file(tmp_path / "tokens.jsonl", 3)
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--no-progress",
            "-",
            f"tokens={tokens}",
            "online=true",
            f"target={tiny_llama_dir}",
            f"out={out}",
            "max_steps=2",
            "drafter.num_hidden_layers=1",
            "drafter.block_size=4",
            "max_tokens=32",
            "tensorboard=false",
        ]
    )
    assert rc == 0 and (out / "final" / "model.safetensors").is_file()
    # on CPU the paper's 512 anchors per document (left at its default here) are named before any model loads
    lines = capsys.readouterr().out.splitlines()
    assert any("note        training on CPU with the GPU-sized default max_anchors 512" in line for line in lines[:10])
    # the longest context a training block read is recorded (rows of max_tokens = 32), and doctor warns beyond it
    from dflashkit.drafter.checkpoint import load_drafter

    trained = load_drafter(out / "final").config.extra["train_context"]
    assert 0 < trained <= 32
    argv = ["doctor", "--target", str(tiny_llama_dir), "--drafter", str(out / "final"), "--prompts", "1"]
    main([*argv, "--max-new-tokens", "4", "--context", "500"])  # within the target's 512 positions
    assert f"exceed the longest training context ({trained} tokens)" in capsys.readouterr().out
