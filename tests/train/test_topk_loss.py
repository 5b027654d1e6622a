"""`loss: topk`: the target's top-k log-probs captured per position, and the sparse KL (+ CE mix) trained on them.

(a) captured ids / log-probs are `log_softmax(HF logits).topk(k)`; float16 storage is adequate; online = captured
(b) the sparse loss with k = V equals the dense kind="kl" loss and its gradients
(c) with k < V it equals a Python loop over slots (renormalised KL + α·CE, dropped entries, CE fallback)
(d) slot k at anchor a reads the stored top-k at index a+k−1 of the same document, never across documents
(e) a reduced draft vocabulary drops the entries outside it before renormalising
(f) train(loss="topk") on captured features runs, the loss falls, and resume reproduces an uninterrupted run
(g) manifests older than store_topk still load; loss: topk without top-k features is a clear DataError
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import read_tensors, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError, DataError
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.captured import CapturedFeatures
from dflashkit.features.manifest import MANIFEST_NAME, Manifest, bytes_per_token
from dflashkit.features.online import OnlineFeatures
from dflashkit.target.model import Target
from dflashkit.train.blocks import build_blocks
from dflashkit.train.config import TrainConfig, check_resume_compatible
from dflashkit.train.loop import train
from dflashkit.train.losses import LossSpec, LossTarget, block_loss, decay_weights
from dflashkit.train.metrics import read_metrics
from dflashkit.train.packing import collate_rows, pack_row
from dflashkit.train.slot_targets import (
    block_labels,
    draft_vocab_head,
    draft_vocab_topk,
    kl_target_logits,
    topk_targets,
)
from dflashkit.train.state import latest_checkpoint
from dflashkit.train.step import row_anchors
from helpers.weights_close import assert_grads_close

DRAFTER = {"num_hidden_layers": 1, "block_size": 4}
K = 6


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


@pytest.fixture(scope="module")
def layer_ids(target: Target) -> list[int]:
    return default_drafter_config(target, **DRAFTER).target_layer_ids


def make_samples(lengths: list[int], seed: int = 0, prompt: int = 4) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for j, n in enumerate(lengths):
        mask = torch.ones(n, dtype=torch.bool)
        mask[:prompt] = False
        out.append(Sample(id=f"s{j}", input_ids=torch.randint(3, 97, (n,), generator=g), loss_mask=mask))
    return out


def quiet_capture(target, samples, out, **kw):
    """capture() without output; `kw` are CaptureSettings fields."""
    return capture(target, samples, out, settings=CaptureSettings(**kw), progress=False, log=None)


@pytest.fixture(scope="module")
def captured(target: Target, layer_ids: list[int], tmp_path_factory) -> Path:
    """4 samples with their top-K log-probs (fp32 features), the drafter's layers."""
    out = tmp_path_factory.mktemp("topk") / "feats"
    quiet_capture(target, make_samples([18, 22, 26, 30]), out, layer_ids=layer_ids, dtype="fp32", store_topk=K)
    return out


# ---------------------------------------------------------------------------------------------- (a) capture
def test_captured_topk_is_log_softmax_topk_of_the_hf_logits(target: Target, tmp_path: Path) -> None:
    samples = make_samples([7, 12, 5, 12])
    m = quiet_capture(
        target, samples, tmp_path, layer_ids=[1, 4], dtype="bf16", store_topk=K, batch_tokens=24, shard_max_tokens=20
    )
    assert m.store_topk == K and Manifest.load(tmp_path).store_topk == K
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["store_topk"] == K
    ds = CapturedFeatures(tmp_path, require_topk=K)
    for s, got in zip(samples, ds, strict=True):
        ref = torch.log_softmax(
            target.model(input_ids=s.input_ids[None], output_hidden_states=True).logits[0].float(), dim=-1
        )  # (T, V)
        vals, ids = ref.topk(K + 1, dim=-1)  # (T, K+1)
        diff = vals[:, :-1] - vals[:, 1:]  # (T, K) ≥ 0
        gap = torch.minimum(F.pad(diff[:, :-1], (1, 0), value=1.0), diff)  # to the neighbours of entry j < K
        vals, ids = vals[:, :K], ids[:, :K]  # (T, K)
        assert got.topk_ids.dtype == torch.long and got.topk_logprobs.dtype == torch.float32
        assert got.topk_ids.shape == got.topk_logprobs.shape == (len(s), K)
        # float16 storage: off by ≤ half a float16 step (|ℓ|·2^-11), one step allowing the last-bit difference
        # between this forward and the capture's
        tol = vals.abs() * 2.0**-10 + 1e-6
        assert ((got.topk_logprobs - vals).abs() <= tol).all()
        # every stored id has the stored log-prob, ids are distinct; they equal HF's ids except where values tie
        assert ((ref.gather(1, got.topk_ids) - got.topk_logprobs).abs() <= tol).all()
        assert all(len(set(r)) == K for r in got.topk_ids.tolist())
        clear = gap > 1e-2
        assert clear.float().mean() > 0.8 and torch.equal(got.topk_ids[clear], ids[clear])
        assert torch.equal(got.topk_ids[:, 0], got.target_tokens)  # top-1 = argmax
        # float16 is adequate: the renormalised distribution moves by a KL of < 1e-6 nats
        q32, q16 = vals.softmax(-1), vals.half().float().softmax(-1)
        assert float((q32 * (q32.log() - q16.log())).sum(-1).max()) < 1e-6
    # online features compute the same (float16-rounded) values: bit-identical where the capture ran the sample
    # alone (0, 2); samples 1 and 3 shared a batched forward, whose logits may differ in the last bits
    online = OnlineFeatures(target, samples, layer_ids=[1, 4], store_topk=K)
    for i in (0, 2):
        assert torch.equal(ds[i].topk_ids, online[i].topk_ids)
        assert torch.equal(ds[i].topk_logprobs, online[i].topk_logprobs)
    for i in (1, 3):
        torch.testing.assert_close(ds[i].topk_logprobs, online[i].topk_logprobs, rtol=2.0**-10, atol=1e-6)
    assert OnlineFeatures(target, samples, layer_ids=[1, 4])[0].topk_ids is None
    # a resumed capture must keep store_topk
    with pytest.raises(DataError, match=r"store_topk 6 but this run has 0"):
        quiet_capture(target, samples, tmp_path, layer_ids=[1, 4], dtype="bf16", store_topk=0)


def test_disk_cost_and_cli_flag(target: Target, tiny_llama_dir: Path, tmp_path: Path, capsys) -> None:
    from dflashkit.cli import main

    assert bytes_per_token(5 * 576, "bf16", True) == 5 * 576 * 2 + 9 == 5769
    assert bytes_per_token(5 * 576, "bf16", True, store_topk=32) == 5769 + 32 * 6 == 5961
    samples = make_samples([7, 9])
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(
        "".join(
            json.dumps({"id": s.id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.int().tolist()}) + "\n"
            for s in samples
        )
    )
    assert (
        main(
            [
                "capture",
                "--target",
                str(tiny_llama_dir),
                "--tokens",
                str(tokens),
                "--out",
                str(tmp_path / "f"),
                "--layer-ids",
                "1,4",
                "--topk",
                "4",
                "--quiet",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "+ top-4 log-probs (24 B/token)" in text and "top-4 log-probs," in text
    assert CapturedFeatures(tmp_path / "f")[1].topk_ids.shape == (9, 4)
    with pytest.raises(DataError, match="store_topk"):
        quiet_capture(target, samples, tmp_path / "g", layer_ids=[1], store_topk=target.vocab_size + 1)


# ---------------------------------------------------------------------------------------------- (b), (c) loss
def _problem(seed: int, dtype: torch.dtype, n: int = 6, bs: int = 4, h: int = 6, v: int = 13):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, bs, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n, bs), generator=g)
    labels[torch.rand(n, bs, generator=g) < 0.25] = -100
    labels[0] = -100  # one padding block
    target = torch.randn(n, bs, v, generator=g, dtype=dtype) * 2
    return hidden, weight, labels, target


def _grads(hidden, weight, fn):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w)
    loss.backward()
    return loss.detach(), [h.grad, w.grad]


@pytest.mark.parametrize("chunk", [2, None])
def test_topk_over_the_whole_vocabulary_equals_dense_kl(chunk: int | None) -> None:
    """float32 throughout: the two paths compute q (softmax vs renormalised exp) and the KL in a different order,
    so they agree to a few float32 roundings (unit 6e-8) over V = 13 terms — rel 1e-5 leaves a wide margin."""
    hidden, weight, labels, target = _problem(0, torch.float32)
    vals, ids = target.log_softmax(-1).topk(target.shape[-1], dim=-1)  # k = V: every token
    dense_target, sparse_target = LossTarget(logits=target), LossTarget(topk_ids=ids, topk_logprobs=vals)
    dense, g_dense = _grads(
        hidden, weight, lambda h, w: block_loss(h, w, labels, LossSpec(kind="kl", chunk_size=chunk), dense_target).loss
    )
    sparse, g_sparse = _grads(
        hidden,
        weight,
        lambda h, w: block_loss(h, w, labels, LossSpec(kind="topk", chunk_size=chunk), sparse_target).loss,
    )
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=0)
    assert_grads_close(g_sparse, g_dense, rel=1e-5)


def _reference(hidden, weight, labels, ids, logprobs, alpha):
    """Σ_slots w_k·ℓ / Σ w_k with ℓ = (1−α)·KL(renormalised kept top-k ‖ p) + α·CE, plain Python over slots."""
    w = decay_weights(labels.shape[1]).to(hidden.dtype)
    total, wsum = hidden.new_zeros(()), hidden.new_zeros(())
    for n in range(labels.shape[0]):
        for k in range(labels.shape[1]):
            if labels[n, k] == -100:
                continue
            logp = torch.log_softmax(hidden[n, k] @ weight.t(), dim=-1)  # (V,)
            keep = [
                (int(i), lp) for i, lp in zip(ids[n, k], logprobs[n, k], strict=True) if i >= 0 and lp > float("-inf")
            ]
            ce = -logp[labels[n, k]]
            if keep:
                q = torch.softmax(torch.stack([lp for _, lp in keep]), dim=0)
                kl = sum(q[j] * (q[j].log() - logp[i]) for j, (i, _) in enumerate(keep))
                per = (1 - alpha) * kl + alpha * ce
            else:
                per = ce  # nothing kept: hard label
            total = total + w[k] * per
            wsum = wsum + w[k]
    return total / wsum


@pytest.mark.parametrize("alpha", [0.0, 0.3])
def test_sparse_topk_loss_equals_python_loop(alpha: float) -> None:
    hidden, weight, labels, target = _problem(1, torch.float64)
    vals, ids = target.log_softmax(-1).topk(5, dim=-1)  # (N, bs, 5)
    g = torch.Generator().manual_seed(7)
    drop = torch.rand(ids.shape, generator=g) < 0.3
    ids = torch.where(drop & (torch.rand(ids.shape, generator=g) < 0.5), -1, ids)  # dropped by id …
    vals = torch.where(drop & (ids >= 0), float("-inf"), vals)  # … or by log-prob
    valid = (labels != -100).nonzero()
    n0, k0 = valid[valid[:, 1] > 0][0].tolist()
    ids[n0, k0] = -1  # a slot with nothing kept
    ref, g_ref = _grads(hidden, weight, lambda h, w: _reference(h, w, labels, ids, vals, alpha))
    topk = LossTarget(topk_ids=ids, topk_logprobs=vals)
    for chunk in (1, 4, None):
        out, g_out = _grads(
            hidden,
            weight,
            lambda h, w, chunk=chunk: (
                block_loss(h, w, labels, LossSpec(kind="topk", ce_weight=alpha, chunk_size=chunk), topk).loss
            ),
        )
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(g_out[0], g_ref[0])  # w.r.t. hidden
        torch.testing.assert_close(g_out[1], g_ref[1])  # w.r.t. the head
    # α = 1 is plain CE; accuracy and counts are those of the hard labels
    ce = block_loss(hidden, weight, labels)
    one = block_loss(hidden, weight, labels, LossSpec(kind="topk", ce_weight=1.0), topk)
    torch.testing.assert_close(one.loss, ce.loss)
    assert torch.equal(one.correct_counts, ce.correct_counts) and torch.equal(one.valid_counts, ce.valid_counts)
    with pytest.raises(ValueError, match="topk_ids"):
        block_loss(hidden, weight, labels, LossSpec(kind="topk"))
    with pytest.raises(ValueError, match="vocabulary"):
        block_loss(hidden, weight, labels, LossSpec(kind="topk"), LossTarget(topk_ids=ids + 100, topk_logprobs=vals))
    with pytest.raises(ValueError, match="ce_weight"):
        block_loss(hidden, weight, labels, LossSpec(ce_weight=0.5))


# ---------------------------------------------------------------------------------------------- (d) alignment
def test_slot_k_reads_the_topk_at_a_plus_k_minus_1_of_its_own_document() -> None:
    """Two documents in one row; the stored top-k of document d at index i is tagged 1000·d + 10·i + j, so the
    q of every slot names the document and index it came from."""
    docs = []
    for d, n in enumerate((9, 11)):
        ids = torch.arange(n) + 3
        tags = 1000 * d + 10 * torch.arange(n)[:, None] + torch.arange(3)  # (T, 3)
        mask = torch.ones(n, dtype=torch.bool)
        docs.append(
            Sample(
                f"d{d}",
                ids,
                mask,
                torch.zeros(n, 2),
                tags[:, 0].clone(),
                topk_ids=tags,
                topk_logprobs=-tags.float() / 1e4,
            )
        )
    rows = collate_rows([pack_row(docs, 32)], [0], pad_to_multiple=8)  # padding at the end
    anchors = row_anchors(rows, seed=0, epoch=0, max_anchors=512)
    blocks = build_blocks(rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask, block_size=4, anchors=anchors)
    got_ids, got_lps = topk_targets(blocks, rows)  # (1, Nb, 4, 3)
    tgt = block_labels(blocks, rows, "target")
    offset, checked, cut = [0, 9], 0, 0
    for n, a in enumerate(blocks.anchors[0].tolist()):
        d = int(rows.doc_ids[0, a])
        local = a - offset[d]
        assert (got_ids[0, n, 0] == -1).all() and (got_lps[0, n, 0] == float("-inf")).all()  # anchor slot
        for k in range(1, 4):
            if local + k >= len(docs[d]):  # the block runs past its document: no target
                assert (got_ids[0, n, k] == -1).all() and (got_lps[0, n, k] == float("-inf")).all()
                cut += 1
                continue
            assert torch.equal(got_ids[0, n, k], docs[d].topk_ids[local + k - 1])
            assert torch.equal(got_lps[0, n, k], docs[d].topk_logprobs[local + k - 1])
            assert tgt[0, n, k] == got_ids[0, n, k, 0]  # same index as labels="target" uses
            checked += 1
    assert checked > 30 and cut > 5
    few, _ = topk_targets(blocks, rows, k=2)
    assert torch.equal(few, got_ids[..., :2])
    with pytest.raises(DataError, match="more entries"):
        topk_targets(blocks, rows, k=4)


def test_slot_k_reads_the_targets_logits_at_a_plus_k_minus_1_of_its_own_document() -> None:
    """loss: kl (and tv, nla, lk): the dense logits each slot is trained towards. A stand-in target answers every
    position with its input id in every entry; ids tag document and index (100·d + i + 3), so each slot's logits
    name the index they came from."""
    docs = []
    for d, n in enumerate((9, 11)):
        ids = 100 * d + torch.arange(n) + 3
        docs.append(Sample(f"d{d}", ids, torch.ones(n, dtype=torch.bool), torch.zeros(n, 2), ids.clone()))
    rows = collate_rows([pack_row(docs, 32)], [0], pad_to_multiple=8)
    blocks = build_blocks(rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask, block_size=4,
                          anchors=row_anchors(rows, seed=0, epoch=0, max_anchors=512))  # fmt: skip

    class Echo:  # (1, n) ids → logits (1, n, 5): each row its id
        def forward(self, ids, logits=True):
            return SimpleNamespace(logits=ids[..., None].float().expand(*ids.shape, 5))

    run = SimpleNamespace(target=Echo(), device=torch.device("cpu"))
    got = kl_target_logits(run, rows, blocks)(0, blocks.num_blocks)  # (Nb, 4, 5)
    offset, checked = [0, 9], 0
    for n, a in enumerate(blocks.anchors[0].tolist()):
        d = int(rows.doc_ids[0, a])
        for k in range(1, 4):
            if a - offset[d] + k < len(docs[d]):  # inside the document (beyond it the slot has no label)
                assert (got[n, k] == float(docs[d].input_ids[a - offset[d] + k - 1])).all(), (n, k)
                checked += 1
    assert checked > 30


# ---------------------------------------------------------------------------------------------- (e) draft vocab
def test_reduced_draft_vocabulary_drops_entries_outside_it() -> None:
    cfg = DrafterConfig(
        hidden_size=6,
        vocab_size=13,
        num_target_layers=8,
        target_layer_ids=[1, 4, 6],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=8,
        block_size=4,
        mask_token_id=5,
        draft_vocab_size=5,
    )
    drafter = DFlashDrafter(cfg)
    d2t = torch.tensor([1, 3, 4, 8, 11])
    drafter.draft_to_target.copy_(d2t)
    ids = torch.tensor([[3, 2, 11, -1], [0, 2, 5, 6]])
    assert draft_vocab_topk(drafter, ids, 13).tolist() == [[1, -1, 4, -1], [-1, -1, -1, -1]]
    hidden, weight, labels, target = _problem(2, torch.float64)  # target vocabulary 13
    labels[labels >= 0] = d2t[torch.randint(0, 5, (int((labels >= 0).sum()),))]  # labels in the draft vocab
    vals, top = target.log_softmax(-1).topk(6, dim=-1)  # target ids
    head, mapped_labels = draft_vocab_head(drafter, weight, labels)
    mapped = draft_vocab_topk(drafter, top, 13)
    t2d = {int(t): i for i, t in enumerate(d2t)}
    want = [[[t2d.get(int(t), -1) for t in slot] for slot in row] for row in top]
    assert mapped.tolist() == want
    n0, k0 = (labels[:, 1:] >= 0).nonzero()[0].tolist()
    mapped[n0, k0 + 1] = -1  # as if its top-6 all missed the draft vocabulary:
    assert ((mapped == -1).all(-1) & (labels >= 0)).any()  # that slot falls back to CE
    ref, g_ref = _grads(hidden, head, lambda h, w: _reference(h, w, mapped_labels, mapped, vals, 0.2))
    spec, topk = LossSpec(kind="topk", ce_weight=0.2, chunk_size=2), LossTarget(topk_ids=mapped, topk_logprobs=vals)
    out, g_out = _grads(hidden, head, lambda h, w: block_loss(h, w, mapped_labels, spec, topk).loss)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g_out[0], g_ref[0])
    torch.testing.assert_close(g_out[1], g_ref[1])


# ---------------------------------------------------------------------------------------------- (f) training
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
        loss="topk",
    )
    base.update(kw)
    return TrainConfig(**base)


def test_train_on_captured_topk_learns_and_resumes_exactly(tmp_path: Path, target: Target, captured: Path) -> None:
    kw = dict(features=str(captured), topk_ce_weight=0.1, val_samples=1, eval_every=4)
    straight = train(cfg_for(tmp_path / "a", **kw), target=target)
    assert straight.step == 8 and straight.val_metrics is not None
    losses = [r["loss"] for r in read_metrics(tmp_path / "a" / "metrics.jsonl") if r["split"] == "train"]
    assert all(0 < v < 50 for v in losses) and losses[-1] < losses[0]

    def kill(end) -> None:
        if end.step == 4:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(cfg_for(tmp_path / "b", **kw), target=target, callbacks=[kill])
    assert latest_checkpoint(tmp_path / "b").name == "step-000004"
    with pytest.raises(ConfigError, match=r"topk_ce_weight was 0.1"):
        train(cfg_for(tmp_path / "b", **{**kw, "topk_ce_weight": 0.2}), target=target)
    resumed = train(cfg_for(tmp_path / "b", **kw), target=target)
    assert resumed.step == 8
    a, b = read_tensors(tmp_path / "a" / "final"), read_tensors(tmp_path / "b" / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    lb = [r["loss"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["split"] == "train"]
    assert len(lb) == 8 and losses == pytest.approx(lb, abs=1e-6)


def test_train_topk_online_and_with_a_draft_vocabulary(
    tmp_path: Path, target: Target, tiny_llama_dir: Path, layer_ids: list[int]
) -> None:
    samples = make_samples([20, 24])
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(
        "".join(
            json.dumps({"id": s.id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.int().tolist()}) + "\n"
            for s in samples
        )
    )
    online = train(
        cfg_for(
            tmp_path / "o",
            tokens=str(tokens),
            online=True,
            target=str(tiny_llama_dir),
            topk=8,
            max_steps=2,
            save_every=0,
        ),
        target=target,
    )
    assert online.step == 2 and 0 < online.train_metrics["loss"] < 50
    dcfg = default_drafter_config(target, **DRAFTER, draft_vocab_size=24)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dcfg)
    drafter.draft_to_target.copy_(torch.randperm(target.vocab_size)[:24].sort().values)
    save_drafter(drafter, tmp_path / "init")
    src = OnlineFeatures(target, samples, layer_ids=layer_ids, store_topk=8)
    run = train(
        cfg_for(tmp_path / "d", init_from=str(tmp_path / "init"), max_steps=2, save_every=0),
        dataset=[src[i] for i in range(len(src))],
        target=target,
    )
    assert run.step == 2 and 0 < run.train_metrics["loss"] < 50


# ---------------------------------------------------------------------------------------------- (g) compatibility
def test_old_manifest_loads_and_topk_without_topk_features_is_a_clear_error(
    tmp_path: Path, target: Target, layer_ids: list[int]
) -> None:
    feats = tmp_path / "feats"
    samples = make_samples([18, 20])
    quiet_capture(target, samples, feats, layer_ids=layer_ids, dtype="fp32")
    raw = json.loads((feats / MANIFEST_NAME).read_text())
    assert raw.pop("store_topk") == 0
    (feats / MANIFEST_NAME).write_text(json.dumps(raw))  # as written before the option
    assert Manifest.load(feats).store_topk == 0
    ds = CapturedFeatures(feats, expect_target=target, expect_layer_ids=layer_ids)
    assert ds[1].topk_ids is None and ds[1].features.shape[0] == 20
    assert quiet_capture(target, samples, feats, layer_ids=layer_ids, dtype="fp32").complete  # still resumable
    with pytest.raises(
        DataError,
        match=rf"loss: topk .*{re.escape(str(feats))}.*without the target's top-k.*"
        rf"--topk 32",
    ):
        train(cfg_for(tmp_path / "run", features=str(feats)), target=target)
    quiet_capture(target, samples, tmp_path / "six", layer_ids=layer_ids, store_topk=6)
    with pytest.raises(DataError, match="holds only the top-6 log-probs per position, but 8"):
        train(cfg_for(tmp_path / "run8", features=str(tmp_path / "six"), topk=8), target=target)
    with pytest.raises(DataError, match=r"Sample\.topk_ids.*--topk"):  # samples without top-k
        train(cfg_for(tmp_path / "list", max_steps=1), dataset=ds, target=target)


def test_config_fields_validate_and_old_checkpoints_stay_resumable() -> None:
    assert TrainConfig.load(None, ["loss=topk", "topk_ce_weight=5e-1", "topk=16"]).topk_ce_weight == 0.5  # YAML 1.2
    with pytest.raises(ConfigError, match='topk_ce_weight = "5e-1": expected a number from 0 to 1'):  # a string
        TrainConfig.from_dict({"loss": "topk", "topk_ce_weight": "5e-1"})
    with pytest.raises(ConfigError, match=r"topk_ce_weight = 1.5: expected a number from 0 to 1"):
        TrainConfig.from_dict({"loss": "topk", "topk_ce_weight": 1.5})
    with pytest.raises(ConfigError, match="it only applies to loss: topk"):
        TrainConfig.from_dict({"topk_ce_weight": 0.2})
    with pytest.raises(ConfigError, match=r"topk = 0: expected an integer ≥ 1 and < 2\^31, or null"):
        TrainConfig.from_dict({"loss": "topk", "topk": 0})
    now = TrainConfig(loss="ce")
    saved = {k: v for k, v in now.to_dict().items() if k not in ("topk", "topk_ce_weight")}
    check_resume_compatible(saved, now, where="old")  # predates the fields: their defaults
    with pytest.raises(ConfigError, match="loss was 'ce'"):
        check_resume_compatible(saved, TrainConfig(loss="topk", topk_ce_weight=0.1), where="old")
    assert (
        "topk (KL to the target's top-16, renormalised; CE weight 0.25)"
        in TrainConfig(loss="topk", topk=16, topk_ce_weight=0.25, features="f").summary()
    )
