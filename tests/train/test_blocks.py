"""Tests of dflashkit.train.blocks: anchors, block labels, and the three mask builders against a naive reference,
plus the key equivalence: a packed training forward under the mask == per-block inference forwards."""

from __future__ import annotations

import pytest
import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.train.blocks import (
    BlockBatch,
    build_blocks,
    candidate_anchors,
    dense_mask,
    flex_mask_mod,
    masks_for_layer_types,
    reference_mask,
    sample_anchors,
)


def packed_row(seed: int, t: int = 48, vocab: int = 50) -> dict[str, torch.Tensor]:
    """Random packed row: 2–4 documents (prompt unsupervised, response supervised with holes), then padding."""
    g = torch.Generator().manual_seed(seed)
    doc_ids = torch.full((t,), -1, dtype=torch.long)
    positions = torch.zeros(t, dtype=torch.long)
    loss_mask = torch.zeros(t, dtype=torch.bool)
    i, d = 0, 0
    n_docs = int(torch.randint(2, 5, (1,), generator=g))
    while d < n_docs and i < t - 4:
        length = min(int(torch.randint(4, 20, (1,), generator=g)), t - i - int(torch.randint(0, 4, (1,), generator=g)))
        if length < 2:
            break
        doc_ids[i : i + length] = d
        positions[i : i + length] = torch.arange(length)
        prompt = int(torch.randint(0, length // 2 + 1, (1,), generator=g))
        loss_mask[i + prompt : i + length] = True
        loss_mask[i : i + length] &= torch.rand(length, generator=g) > 0.1
        i += length
        d += 1
    input_ids = torch.randint(2, vocab, (t,), generator=g)
    return {"input_ids": input_ids, "doc_ids": doc_ids, "positions": positions, "loss_mask": loss_mask}


def loop_candidates(row: dict[str, torch.Tensor]) -> list[int]:
    d, m = row["doc_ids"].tolist(), row["loss_mask"].tolist()
    return [a for a in range(len(d) - 1) if m[a] and m[a + 1] and d[a] == d[a + 1] and d[a] >= 0]


# ---------------------------------------------------------------------------------------------- anchors
@pytest.mark.parametrize("seed", range(5))
def test_candidates_match_definition(seed: int) -> None:
    row = packed_row(seed)
    assert candidate_anchors(row["doc_ids"], row["loss_mask"]).tolist() == loop_candidates(row)


def test_sampler_valid_sorted_capped_and_seeded() -> None:
    row = packed_row(1, t=200)
    cands = set(loop_candidates(row))
    docs = row["doc_ids"]
    draws = []
    for seed in range(6):
        a = sample_anchors(docs, row["loss_mask"], max_anchors=3, generator=torch.Generator().manual_seed(seed))
        assert set(a.tolist()) <= cands
        assert a.tolist() == sorted(set(a.tolist()))
        per_doc = torch.bincount(docs[a], minlength=int(docs.max()) + 1)
        assert int(per_doc.max()) <= 3
        # each document with ≥ 3 candidates contributes exactly 3
        for d in docs[docs >= 0].unique().tolist():
            n_c = sum(1 for c in cands if docs[c] == d)
            assert int(per_doc[d]) == min(3, n_c)
        draws.append(tuple(a.tolist()))
    assert len(set(draws)) > 1, "different seeds should give different anchors"
    again = sample_anchors(docs, row["loss_mask"], max_anchors=3, generator=torch.Generator().manual_seed(2))
    assert tuple(again.tolist()) == draws[2]
    everything = sample_anchors(docs, row["loss_mask"], max_anchors=512, generator=torch.Generator().manual_seed(0))
    assert everything.tolist() == sorted(cands)


def drawn(rows: dict, *, seed: int) -> list[torch.Tensor]:
    """`sample_anchors` per row of `rows` ((T,) or (B, T) tensors), one generator over the rows."""
    g = torch.Generator().manual_seed(seed)
    docs, lm = rows["doc_ids"].long(), rows["loss_mask"].bool()
    docs, lm = (docs[None], lm[None]) if docs.dim() == 1 else (docs, lm)
    return [sample_anchors(docs[i], lm[i], max_anchors=512, generator=g) for i in range(docs.shape[0])]


# ---------------------------------------------------------------------------------------------- labels
@pytest.mark.parametrize("bs", [2, 4, 16])
def test_labels_and_positions(bs: int) -> None:
    rows = [packed_row(10 + bs), packed_row(20 + bs)]
    stacked = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    batch = build_blocks(**stacked, block_size=bs, anchors=drawn(stacked, seed=0))
    t = stacked["doc_ids"].shape[1]
    assert batch.labels.shape == (2, batch.num_blocks, bs)
    for b, row in enumerate(rows):
        d, p, m, ids = (row[k].tolist() for k in ("doc_ids", "positions", "loss_mask", "input_ids"))
        for i, a in enumerate(batch.anchors[b].tolist()):
            if a < 0:
                assert batch.labels[b, i].eq(-100).all() and not batch.label_valid[b, i].any()
                assert batch.block_positions[b, i * bs : (i + 1) * bs].tolist() == list(range(bs))
                assert int(batch.block_doc_ids[b, i]) == -1 and int(batch.first_tokens[b, i]) == 0
                continue
            assert int(batch.first_tokens[b, i]) == ids[a]
            for k in range(bs):
                j = a + k
                ok = j < t and d[j] == d[a] and p[j] == p[a] + k and m[j]
                assert int(batch.labels[b, i, k]) == (ids[j] if ok else -100)
                assert int(batch.block_positions[b, i * bs + k]) == p[a] + k
    real = batch.block_valid[:, :, None].expand_as(batch.label_valid)
    if bs == 2:  # anchor + 1 is a candidate's requirement, so every real slot is valid
        assert torch.equal(real, batch.label_valid)
    else:  # blocks running past the end of their document exist and are partially invalid
        assert (real & ~batch.label_valid).any()


# ---------------------------------------------------------------------------------------------- masks
def _batch_with_padding(seed: int, bs: int) -> tuple[list[dict[str, torch.Tensor]], BlockBatch]:
    rows = [packed_row(seed), packed_row(seed + 100)]
    stacked = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    g = torch.Generator().manual_seed(seed)
    anchors = [sample_anchors(r["doc_ids"], r["loss_mask"], max_anchors=4, generator=g) for r in rows]
    anchors[1] = anchors[1][: max(1, anchors[1].numel() // 2)]  # rows with different anchor counts
    batch = build_blocks(**stacked, block_size=bs, anchors=anchors, num_blocks=max(a.numel() for a in anchors) + 1)
    assert (batch.anchors == -1).any()
    return rows, batch


MASK_CASES = [(bs, causal, window) for bs in (2, 4, 16) for causal in (False, True) for window in (None, 3)]


@pytest.mark.parametrize("bs,causal,window", MASK_CASES)
def test_dense_and_flex_match_reference(bs: int, causal: bool, window: int | None) -> None:
    from torch.nn.attention.flex_attention import create_mask

    for seed in range(3):
        rows, batch = _batch_with_padding(seed, bs)
        dense = dense_mask(batch, causal_in_block=causal, window=window)
        nq, kv = batch.num_queries, batch.context_len + batch.num_queries
        assert dense.shape == (2, 1, nq, kv) and dense.dtype == torch.bool
        mod = flex_mask_mod(batch, causal_in_block=causal, window=window)
        flex = create_mask(mod, 2, None, nq, kv, device="cpu")
        bi = torch.arange(2)[:, None, None, None]
        qi, ki = torch.arange(nq)[None, None, :, None], torch.arange(kv)[None, None, None, :]
        broadcast = mod(bi, torch.zeros_like(bi), qi, ki)  # the mask_mod over all index pairs
        for b, row in enumerate(rows):
            ref = reference_mask(
                row["doc_ids"], row["positions"], batch.anchors[b], bs, causal_in_block=causal, window=window
            )
            assert torch.equal(dense[b, 0], ref)
            assert torch.equal(flex[b, 0].bool(), ref)
            assert torch.equal(broadcast[b, 0], ref)
            assert ref.any(dim=1).all(), "no query row may be fully masked"
            pad = (batch.anchors[b] < 0).repeat_interleave(bs)
            assert not ref[pad, : batch.context_len].any(), "padding blocks see no context"


def test_strict_context_and_overlapping_blocks() -> None:
    t, bs = 12, 4
    doc_ids = torch.tensor([0] * 5 + [1] * 7)
    positions = torch.tensor(list(range(5)) + list(range(7)))
    loss_mask = torch.ones(t, dtype=torch.bool)
    anchors = torch.tensor([7, 8])  # doc 1, positions 2 and 3: overlapping
    batch = build_blocks(torch.arange(t), doc_ids, positions, loss_mask, block_size=bs, anchors=anchors)
    for causal in (False, True):
        m = dense_mask(batch, causal_in_block=causal)[0, 0]  # (8, 12 + 8)
        assert torch.equal(m, reference_mask(doc_ids, positions, anchors, bs, causal_in_block=causal))
        blk_a, blk_b = m[:bs], m[bs:]
        # block at index 7 (position 2) sees exactly doc-1 keys at positions 0, 1 (indices 5, 6)
        assert blk_a[:, :t].nonzero()[:, 1].unique().tolist() == [5, 6]
        assert not blk_a[:, 7].any() and not blk_b[:, 8].any(), "the anchor's own position is not context"
        assert blk_b[:, :t].nonzero()[:, 1].unique().tolist() == [5, 6, 7]
        assert not blk_a[:, :5].any() and not blk_b[:, :5].any(), "another document is invisible"
        assert not blk_a[:, t + bs :].any() and not blk_b[:, t : t + bs].any(), "blocks never see each other"
        assert blk_a[:, t : t + bs].diagonal().all() and blk_b[:, t + bs :].diagonal().all()
    assert batch.labels[0].tolist() == [[7, 8, 9, 10], [8, 9, 10, 11]]


def test_window_by_position() -> None:
    doc_ids = torch.zeros(10, dtype=torch.long)
    positions = torch.arange(10)
    batch = build_blocks(
        torch.arange(10), doc_ids, positions, torch.ones(10, dtype=torch.bool), block_size=3, anchors=torch.tensor([6])
    )
    m = dense_mask(batch, causal_in_block=True, window=2)[0, 0]
    # slot 0 (position 6) sees context position 5 only; slot 2 (position 8) sees no context, block slots 1, 2
    assert m[0, :10].nonzero().flatten().tolist() == [5]
    assert not m[2, :10].any() and m[2, 10:].tolist() == [False, True, True]


# ---------------------------------------------------------------------------------------------- equivalence
def tiny_config(**kw) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=32,
        vocab_size=50,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        block_size=4,
        mask_token_id=1,
        **kw,
    )


@pytest.mark.parametrize(
    "cfg_kw",
    [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}],
    ids=["full", "sliding+full"],
)
def test_training_mask_forward_equals_per_block_inference(cfg_kw: dict) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(**cfg_kw)
    bs = cfg.block_size
    drafter = DFlashDrafter(cfg).eval()
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    rows = [packed_row(3, t=40), packed_row(4, t=40)]
    stacked = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    t = stacked["doc_ids"].shape[1]
    anchors = [
        sample_anchors(r["doc_ids"], r["loss_mask"], max_anchors=3, generator=torch.Generator().manual_seed(5))
        for r in rows
    ]
    # add a block at the start of a document (empty context) and one running past its document's end
    starts = (stacked["positions"][0] == 0) & (stacked["doc_ids"][0] >= 0)
    ends = torch.ones(t, dtype=torch.bool)
    ends[:-1] = stacked["doc_ids"][0, 1:] != stacked["doc_ids"][0, :-1]
    ends &= stacked["doc_ids"][0] >= 0
    extra = torch.tensor([int(starts.nonzero()[1]), int(ends.nonzero()[0]) - 1])
    anchors[0] = torch.cat([anchors[0], extra]).unique().sort().values
    batch = build_blocks(
        **stacked, block_size=bs, anchors=anchors, num_blocks=max(a.numel() for a in anchors) + 1
    )  # padding blocks in both rows
    assert (batch.anchors == -1).any(dim=1).all()
    features = torch.randn(2, t, cfg.num_features * cfg.hidden_size)
    block_embeds = drafter.block_embeddings(batch.first_tokens, embed, bs)  # (2, Nq, H)
    with torch.no_grad():
        out = drafter(
            features,
            block_embeds,
            context_positions=batch.context_positions,
            block_positions=batch.block_positions,
            attention_mask=masks_for_layer_types(cfg, batch),
        )
        unmasked = drafter(
            features, block_embeds, context_positions=batch.context_positions, block_positions=batch.block_positions
        )
    assert torch.isfinite(out).all()
    checked = 0
    for b in range(2):
        docs, pos = stacked["doc_ids"][b], stacked["positions"][b]
        for i, a in enumerate(batch.anchors[b].tolist()):
            if a < 0:
                continue
            ctx = ((docs == docs[a]) & (pos < pos[a])).nonzero().flatten()  # document, positions < anchor
            blk_pos = (pos[a] + torch.arange(bs))[None]
            with torch.no_grad():
                ref = drafter(
                    features[b : b + 1, ctx],
                    block_embeds[b : b + 1, i * bs : (i + 1) * bs],
                    context_positions=pos[ctx][None],
                    block_positions=blk_pos,
                    attention_mask=None,
                )
            got = out[b : b + 1, i * bs : (i + 1) * bs]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked >= 4
    # an attention path that ignored the mask would not match
    assert not torch.allclose(unmasked, out, atol=1e-3)


def test_masks_for_layer_types_keys() -> None:
    cfg = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=2)
    row = packed_row(0)
    batch = build_blocks(**row, block_size=4, anchors=drawn(row, seed=0))
    masks = masks_for_layer_types(cfg, batch)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert torch.equal(masks["full_attention"], dense_mask(batch))
    assert torch.equal(masks["sliding_attention"], dense_mask(batch, causal_in_block=True, window=2))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("causal,window", [(False, None), (True, 3)])
def test_flex_block_mask_attention_equals_dense_sdpa(causal: bool, window: int | None) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    from dflashkit.train.blocks import flex_block_mask

    _, batch = _batch_with_padding(7, 4)
    block_mask = flex_block_mask(batch, causal_in_block=causal, window=window)
    nq, kv = batch.num_queries, batch.context_len + batch.num_queries
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (nq, kv, kv))
    got = flex_attention(q, k, v, block_mask=block_mask)
    mask = dense_mask(batch, causal_in_block=causal, window=window)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore")
def test_drafter_flex_path_equals_dense_path() -> None:
    """The drafter's flex-attention branch (BlockMask per layer type; CUDA training) gives the same hidden states
    as its SDPA branch with dense masks (CPU), on a sliding + full drafter."""
    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.train.blocks import masks_for_layer_types

    cfg = DrafterConfig(
        hidden_size=32,
        vocab_size=50,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        block_size=4,
        mask_token_id=1,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
    )
    _, batch = _batch_with_padding(7, 4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    feats = torch.randn(batch.batch_size, batch.context_len, 2 * 32)
    embeds = drafter.block_embeddings(batch.first_tokens, torch.randn(50, 32), 4)
    kw = dict(context_positions=batch.context_positions, block_positions=batch.block_positions)
    with torch.no_grad():  # flex attention has no CPU backward; on CUDA it trains
        dense = drafter(feats, embeds, attention_mask=masks_for_layer_types(cfg, batch), **kw)
        flex = drafter(feats, embeds, attention_mask=masks_for_layer_types(cfg, batch, backend="flex"), **kw)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
