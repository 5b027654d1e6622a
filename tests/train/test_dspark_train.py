"""Training DSpark drafters end to end on the tiny target: the labels and previous tokens of each slot against a
Python loop, captured features with the target's final layer equal to online ones, training learns (loss falls,
validation runs) and resumes exactly, and the settings DSpark cannot take are refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.drafter.capture_needs import capture_layer_ids
from dflashkit.drafter.checkpoint import load_drafter, read_tensors, save_drafter
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.target.model import Target
from dflashkit.train.blocks import build_blocks
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.metrics import read_metrics
from dflashkit.train.packing import collate_rows, pack_row
from dflashkit.train.slot_targets import every_slot_labels

DRAFTER = {"num_hidden_layers": 1, "block_size": 4, "kind": "dspark", "markov_rank": 8}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


def make_samples(n: int = 4, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = 18 + 4 * i
        mask = torch.ones(t, dtype=torch.bool)
        mask[:4] = False
        mask[t - 3] = False  # a hole: blocks running over it end their valid prefix there
        out.append(Sample(f"s{i}", torch.randint(3, 97, (t,), generator=g), mask))
    return out


def test_labels_and_prev_tokens_equal_a_python_loop(target: Target) -> None:
    samples = make_samples(2)
    for s in samples:  # packing needs features; the target's argmax: its own labels (labels: target)
        s.features = torch.zeros(len(s), 1)
        s.target_tokens = (s.input_ids * 7 + 3) % 97
    rows = collate_rows([pack_row(samples, 80)], [0])
    anchors = torch.tensor([[4, 12, 16, 22, 35, 38]])  # inside docs, across a hole, over a document end
    blocks = build_blocks(rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask, block_size=4, anchors=anchors)
    labels, prev = every_slot_labels(blocks, rows, "data")
    ids, docs, lm = rows.input_ids[0].tolist(), rows.doc_ids[0].tolist(), rows.loss_mask[0].tolist()
    for n, a in enumerate(anchors[0].tolist()):
        expect, ok = [], True
        for k in range(4):
            i = a + k + 1
            ok = ok and i < len(ids) and docs[i] == docs[a] and lm[i]
            expect.append(ids[i] if ok else -100)
        assert labels[0, n].tolist() == expect, a
        assert prev[0, n].tolist() == [ids[a]] + [max(x, 0) for x in expect[:-1]], a
    target_labels, _ = every_slot_labels(blocks, rows, "target")
    tt = rows.target_tokens[0].tolist()
    for n, a in enumerate(anchors[0].tolist()):  # the target's argmax at a+k predicts the token at a+k+1
        want = [tt[a + k] if labels[0, n, k] >= 0 else -100 for k in range(4)]
        assert target_labels[0, n].tolist() == want, a


def cfg_for(out: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        drafter=dict(DRAFTER),
        max_tokens=48,
        max_steps=8,
        save_every=4,
        progress=False,
        tensorboard=False,
        lr=3e-3,
        val_samples=1,
        eval_every=4,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_captured_final_layer_trains_learns_and_resumes_exactly(
    tmp_path: Path, target: Target, tiny_llama_dir: Path
) -> None:
    cfg = default_drafter_config(target, **DRAFTER)
    layers = capture_layer_ids(cfg)
    assert layers == [*cfg.target_layer_ids, target.num_layers - 1]
    feats = tmp_path / "feats"
    capture(
        target,
        make_samples(),
        feats,
        progress=False,
        log=None,
        settings=CaptureSettings(layer_ids=layers, dtype="fp32"),
    )
    kw = dict(features=str(feats), target=str(tiny_llama_dir))
    straight = train(cfg_for(tmp_path / "a", **kw), target=target)
    assert straight.step == 8 and straight.val_metrics is not None
    recs = [r for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["split"] == "train"]
    assert len(recs[0]["accuracy"]) == 5 and recs[0]["accuracy"][0] == 1.0  # the given token + 4 drafting slots
    assert recs[-1]["loss"] < recs[0]["loss"]
    drafter = load_drafter(tmp_path / "a" / "final")
    assert drafter.config.kind == "dspark" and drafter.markov_head.markov_w2.weight.abs().sum() > 0  # W2 learned

    def kill(end) -> None:
        if end.step == 4:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(cfg_for(tmp_path / "b", **kw), target=target, callbacks=[kill])
    train(cfg_for(tmp_path / "b", **kw), target=target)
    a, b = read_tensors(tmp_path / "a" / "final"), read_tensors(tmp_path / "b" / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_reduced_vocabulary_takes_the_log_sum_exp_once_per_row(
    tmp_path: Path, target: Target, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a draft vocabulary the target's distribution comes from its draft-id logits and a per-row log-sum-exp
    (computed once per row over the whole run, or stored at capture): the losses equal those of its full logits."""
    cfg = default_drafter_config(target, **DRAFTER, draft_vocab_size=40)
    torch.manual_seed(0)
    init = DFlashDrafter(cfg)
    init.draft_to_target.copy_(torch.randperm(target.vocab_size)[:40].sort().values)
    save_drafter(init, tmp_path / "init")
    feats = tmp_path / "feats"
    capture(
        target,
        make_samples(),
        feats,
        progress=False,
        log=None,
        settings=CaptureSettings(layer_ids=capture_layer_ids(cfg), dtype="fp32"),
    )
    kw = dict(features=str(feats), target=str(tiny_llama_dir), init_from=str(tmp_path / "init"), max_steps=9)
    runs = []
    cached = train(cfg_for(tmp_path / "a", **kw), target=target, callbacks=[lambda end: runs.append(end.run)])
    rows = len(runs[-1].rows) + len(runs[-1].val_rows or [])
    assert cached.step == 9 > 2 * len(runs[-1].rows)  # more than two epochs: every row met again
    assert runs[-1].target_lse.computed == rows == len(runs[-1].target_lse)
    monkeypatch.setattr("dflashkit.train.step.capture_target_lse", lambda c, t: False)  # the full-vocabulary path
    train(cfg_for(tmp_path / "b", **kw), target=target)
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    assert [r["split"] for r in a] == [r["split"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4, abs=1e-5)
    # captured with the log-sum-exp: the rows carry it and the cache is never filled, same losses
    monkeypatch.undo()
    stored = tmp_path / "feats-lse"
    layers = capture_layer_ids(cfg)
    capture(
        target,
        make_samples(),
        stored,
        progress=False,
        log=None,
        settings=CaptureSettings(layer_ids=layers, dtype="fp32", store_target_lse=True),
    )
    runs.clear()
    train(
        cfg_for(tmp_path / "c", **{**kw, "features": str(stored)}),
        target=target,
        callbacks=[lambda end: runs.append(end.run)],
    )
    assert runs[-1].target_lse.computed == 0
    c = read_metrics(tmp_path / "c" / "metrics.jsonl")
    assert [r["split"] for r in c] == [r["split"] for r in a]
    for ra, rc in zip(a, c, strict=True):
        assert ra["loss"] == pytest.approx(rc["loss"], rel=1e-4, abs=1e-5)


def test_a_bf16_target_trains_dspark_with_a_draft_vocabulary(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A bf16 target (CUDA's default) with float32 features, on both paths to the target's distribution (the
    log-sum-exp cache with draft-id logits, and the full logits): no dtype clash in the head, the loss falls."""
    target16 = Target.load(tiny_llama_dir, dtype="bf16")
    from dflashkit.data.draft_vocab import frequent_tokens
    from dflashkit.drafter.checkpoint import save_drafter

    for name, drafter in (("reduced", dict(DRAFTER, draft_vocab_size=40)), ("full", dict(DRAFTER))):
        cfg = default_drafter_config(target16, **drafter)
        feats, samples = tmp_path / f"feats-{name}", make_samples()
        capture(
            target16,
            samples,
            feats,
            progress=False,
            log=None,
            settings=CaptureSettings(layer_ids=capture_layer_ids(cfg)),
        )
        init = None
        if cfg.draft_vocab_size:  # a draft vocabulary is built from data
            torch.manual_seed(0)
            fresh = DFlashDrafter(cfg)
            fresh.draft_to_target.copy_(frequent_tokens(samples, vocab_size=cfg.vocab_size, size=40)[0])
            init = str(save_drafter(fresh, tmp_path / f"init-{name}"))
        kw = dict(drafter=drafter, features=str(feats), target=str(tiny_llama_dir), val_samples=0, eval_every=0)
        kw["init_from"] = init
        result = train(cfg_for(tmp_path / name, **kw, max_steps=6, save_every=0), target=target16)
        losses = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["split"] == "train"]
        assert result.step == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_online_equals_captured_and_refusals(tmp_path: Path, target: Target, tiny_llama_dir: Path) -> None:
    import json

    cfg = default_drafter_config(target, **DRAFTER)
    samples = make_samples(3, seed=1)
    feats = tmp_path / "feats"
    capture(
        target,
        samples,
        feats,
        progress=False,
        log=None,
        settings=CaptureSettings(layer_ids=capture_layer_ids(cfg), dtype="fp32"),
    )
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(
        "".join(
            json.dumps({"id": s.id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.int().tolist()}) + "\n"
            for s in samples
        )
    )
    common = dict(target=str(tiny_llama_dir), val_samples=0, eval_every=0, max_steps=3, save_every=0)
    off = train(cfg_for(tmp_path / "off", features=str(feats), **common), target=target)
    on = train(cfg_for(tmp_path / "on", tokens=str(tokens), online=True, **common), target=target)
    l_off = [r["loss"] for r in read_metrics(tmp_path / "off" / "metrics.jsonl") if r["split"] == "train"]
    l_on = [r["loss"] for r in read_metrics(tmp_path / "on" / "metrics.jsonl") if r["split"] == "train"]
    assert off.step == on.step == 3 and l_off == pytest.approx(l_on, rel=1e-4)
    with pytest.raises(ConfigError, match="loss"):
        train(cfg_for(tmp_path / "bad-loss", features=str(feats), **{**common, "loss": "topk"}), target=target)
    dpace = train(cfg_for(tmp_path / "dpace", features=str(feats), **common, position_weights="dpace"), target=target)
    l_dpace = [r["loss"] for r in read_metrics(tmp_path / "dpace" / "metrics.jsonl") if r["split"] == "train"]
    assert dpace.step == 3 and all(math.isfinite(x) for x in l_dpace) and l_dpace[0] != pytest.approx(l_off[0])


def test_training_mask_equals_deepspecs_definition() -> None:
    """DeepSpec's DSpark mask on one unpacked sequence: a block query sees context key j iff j < its anchor and
    every key of its own block (nothing of other blocks) — dflashkit's DFlash mask, which DSpark shares."""
    from dflashkit.train.blocks import dense_mask

    t, bs = 20, 4
    anchors = torch.tensor([[3, 8, 15]])
    ids = torch.arange(t)[None]
    blocks = build_blocks(
        ids, torch.zeros(1, t, dtype=torch.long), torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool),
        block_size=bs, anchors=anchors,
    )  # fmt: skip
    got = dense_mask(blocks)[0, 0]  # (Nq, T + Nq)
    nq = anchors.shape[1] * bs
    for q in range(nq):
        a = int(anchors[0, q // bs])
        for kv in range(t + nq):
            want = kv < a if kv < t else (kv - t) // bs == q // bs
            assert bool(got[q, kv]) == want, (q, kv)
