"""What each block slot is trained towards: hard labels, the target's dense logits, or its stored top-k.

    labels = block_labels(blocks, rows, "target")          # (B, Nb, bs) long, −100 invalid
    ids, logprobs = topk_targets(blocks, rows)             # (B, Nb, bs, K): q for loss: topk, −1 / −inf invalid
    head, labels = draft_vocab_head(drafter, lm_head, labels)   # reduced draft vocabulary: draft ids
    ids = draft_vocab_topk(drafter, ids, vocab)             # … and top-k ids as draft ids, −1 outside it

Alignment ("same position"): slot k of the block at anchor a predicts the token AT index a+k. The target's own
prediction for that token is its output at index a+k−1: `target_tokens[a+k−1]` (labels="target"), the logits at
a+k−1 (loss: kl, `kl_target_logits`), the stored top-k log-probs at a+k−1 (loss: topk). The shift never crosses
a document of a packed row: a slot's target is valid only where its data label is (same document, supervised, in
range), and index a+k−1 ≥ a then lies in the same document. Slot 0 (the clean anchor, weight 0) has no soft
target. Used by `dflashkit.train.loop` (which re-exports these names).

Heads whose every slot drafts (DSpark, Domino: "next position", `every_slot_labels`): slot k drafts the token at
a+k+1 — DFlash's label of slot k+1 in a block one wider — valid on the contiguous prefix of valid slots (teacher
forcing feeds slot k the label of slot k−1); the target's distribution for it is its output at index a+k
(`every_slot_target_index`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.errors import DataError
from dflashkit.train.blocks import BlockBatch, build_blocks
from dflashkit.train.packing import RowBatch


def block_labels(blocks: BlockBatch, rows: RowBatch, mode: str) -> Tensor:
    """Labels (B, Nb, bs) for `mode` "data" (input_ids[a+k]) or "target" (target_tokens[a+k−1]); −100 invalid.

    Slot 0 keeps the data token (it has weight 0). A target label is valid where the data label is valid (same
    document, supervised, in range) and the target token at a+k−1 is known."""
    if mode == "data":
        return blocks.labels
    if rows.target_tokens is None:
        raise DataError(
            "labels: target needs the target's argmax tokens (Sample.target_tokens); capture them "
            "with the features or train with online: true"
        )
    b, t = rows.target_tokens.shape
    bs, nb = blocks.block_size, blocks.num_blocks
    docs = rows.doc_ids
    shifted = torch.full_like(rows.target_tokens, -1)  # (B, T): target's token FOR index i
    same = docs[:, 1:] == docs[:, :-1]
    shifted[:, 1:] = torch.where(same, rows.target_tokens[:, :-1], -1)
    idx = blocks.anchors.clamp(min=0)[:, :, None] + torch.arange(bs, device=docs.device)  # (B, Nb, bs)
    got = shifted.gather(1, idx.clamp(max=t - 1).reshape(b, nb * bs)).view(b, nb, bs)
    labels = torch.where(blocks.label_valid & (got >= 0), got, -100)
    labels[:, :, 0] = blocks.labels[:, :, 0]
    return labels


def every_slot_labels(blocks: BlockBatch, rows: RowBatch, mode: str) -> tuple[Tensor, Tensor]:
    """(labels (B, Nb, γ), prev tokens (B, Nb, γ)) for blocks of γ slots that all draft (DSpark, Domino) at
    `blocks.anchors`: labels are the target ids at a+k+1 ("data") or the target's argmax there ("target"), −100
    after the first invalid slot; prev tokens are the anchor's token for slot 0 and slot k−1's label after it (0
    where no label: never supervised)."""
    g = blocks.block_size
    wide = build_blocks(
        rows.input_ids, rows.doc_ids, rows.positions, rows.loss_mask, block_size=g + 1, anchors=blocks.anchors.cpu()
    )
    nxt = block_labels(wide, rows, mode)[:, :, 1:]  # (B, Nb, γ): DFlash slots 1..γ of the wider block
    prefix = (nxt != -100).long().cumprod(-1).bool()
    labels = torch.where(prefix, nxt, -100)
    prev = torch.cat([wide.first_tokens[:, :, None], labels[:, :, :-1].clamp(min=0)], dim=-1)
    return labels, prev


def every_slot_target_index(blocks: BlockBatch) -> Tensor:
    """(B, Nb, γ) long: the row index a+k whose target output predicts slot k of a block whose every slot drafts
    (clamped into the row)."""
    t = blocks.context_len
    k = torch.arange(blocks.block_size, device=blocks.anchors.device)
    return (blocks.anchors.clamp(min=0)[:, :, None] + k).clamp(max=t - 1)


def topk_targets(blocks: BlockBatch, rows: RowBatch, k: int | None = None) -> tuple[Tensor, Tensor]:
    """The stored top-k of the target's output at index a+k−1 for every slot: (ids (B, Nb, bs, K) long,
    log-probs (B, Nb, bs, K) float32), ids −1 / log-probs −inf where the slot is invalid (see the module
    docstring) or its sample has none. `k` keeps the first (largest) k of the stored entries (None: all)."""
    if rows.topk_ids is None or rows.topk_logprobs is None:
        raise DataError(
            "loss: topk needs the target's top-k log-probs per position (Sample.topk_ids / "
            "topk_logprobs); capture the features with `dflashkit capture --topk 32`, or train with "
            "online: true"
        )
    dev = blocks.anchors.device  # computed where the blocks are
    ids, lps = rows.topk_ids.to(dev), rows.topk_logprobs.to(dev)  # (B, T, K)
    if k is not None:
        if k > ids.shape[-1]:
            raise DataError(
                f"topk: {k} asks for more entries than the features hold ({ids.shape[-1]} per "
                f"position); capture with --topk {k} or lower topk"
            )
        ids, lps = ids[..., :k], lps[..., :k]  # stored sorted, descending
    b, t, kk = ids.shape
    bs, nb = blocks.block_size, blocks.num_blocks
    docs = rows.doc_ids.to(dev)
    same = (docs[:, 1:] == docs[:, :-1])[..., None]  # (B, T−1, 1)
    s_ids = torch.full_like(ids, -1)  # (B, T, K): target's top-k FOR index i
    s_lps = torch.full_like(lps, float("-inf"))
    s_ids[:, 1:] = torch.where(same, ids[:, :-1], -1)
    s_lps[:, 1:] = torch.where(same, lps[:, :-1], float("-inf"))
    idx = (blocks.anchors.clamp(min=0)[:, :, None] + torch.arange(bs, device=dev)).clamp(max=t - 1)  # (B, Nb, bs)
    flat = idx.reshape(b, nb * bs, 1).expand(b, nb * bs, kk)
    got_ids = s_ids.gather(1, flat).view(b, nb, bs, kk)
    got_lps = s_lps.gather(1, flat).view(b, nb, bs, kk)
    ok = blocks.label_valid.clone()  # (B, Nb, bs)
    ok[:, :, 0] = False  # the anchor slot: no soft target
    got_ids = torch.where(ok[..., None], got_ids, -1)
    got_lps = torch.where(ok[..., None] & (got_ids >= 0), got_lps, float("-inf"))
    return got_ids, got_lps


def kl_target_logits(run: Any, rows: RowBatch, blocks: BlockBatch) -> Callable[[int, int], Tensor]:
    """For kind="kl": the target's final-layer logits predicting each slot's token (index a+k−1), as the
    chunk callable `block_loss` takes. Documents of a row run through the target separately."""
    b, t = rows.input_ids.shape
    logits = None
    for i in range(b):
        for d in rows.doc_ids[i].unique().tolist():
            if d < 0:
                continue
            sel = (rows.doc_ids[i] == d).nonzero().flatten()  # contiguous indices of document d
            out = run.target.forward(rows.input_ids[i, sel][None], logits=True).logits[0]  # (n, V)
            if logits is None:
                logits = torch.zeros(b, t, out.shape[-1], dtype=out.dtype, device=run.device)
            logits[i, sel.to(run.device)] = out.to(run.device)
    bs, nb = blocks.block_size, blocks.num_blocks
    idx = (blocks.anchors.clamp(min=0)[:, :, None] + torch.arange(bs, device=run.device) - 1).clamp(0, t - 1)
    flat_b = torch.arange(b, device=run.device).repeat_interleave(nb)  # (B·Nb,)
    flat_idx = idx.reshape(b * nb, bs)  # (B·Nb, bs)
    return lambda r0, r1: logits[flat_b[r0:r1, None], flat_idx[r0:r1]]  # (rows, bs, V)


def _target_to_draft(drafter: Any, vocab: int, device: torch.device) -> Tensor:
    """(vocab,) long: the draft id of every target id, −100 outside the draft vocabulary."""
    d2t = drafter.draft_to_target.to(device)  # (N,)
    t2d = torch.full((vocab,), -100, dtype=torch.long, device=device)
    t2d[d2t] = torch.arange(d2t.numel(), device=device)
    return t2d


def draft_vocab_head(drafter: Any, lm_head: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """With a reduced draft vocabulary: the LM-head rows of the draft tokens (N, H) and labels mapped to draft
    ids; target tokens outside the draft vocabulary get −100 (no loss, not counted in accuracy — they can never
    be drafted, which evaluation measures). Without one: the full head and the labels unchanged."""
    if drafter.config.draft_vocab_size is None:
        return lm_head, labels
    t2d = _target_to_draft(drafter, lm_head.shape[0], labels.device)
    mapped = torch.where(labels >= 0, t2d[labels.clamp(min=0)], torch.full_like(labels, -100))
    return drafter.reduced_head_weight(lm_head), mapped  # a frozen head's rows: gathered once, kept


def draft_vocab_topk(drafter: Any, ids: Tensor, vocab: int) -> Tensor:
    """Top-k target ids (…, K) → draft ids, −1 for entries outside the draft vocabulary (and for −1 entries):
    the loss drops them before renormalising over the rest. Without a reduced vocabulary: `ids` unchanged."""
    if drafter.config.draft_vocab_size is None:
        return ids
    t2d = _target_to_draft(drafter, vocab, ids.device)
    mapped = t2d[ids.clamp(min=0)]
    return torch.where((ids >= 0) & (mapped >= 0), mapped, -1)


__all__ = [
    "block_labels",
    "draft_vocab_head",
    "draft_vocab_topk",
    "every_slot_labels",
    "every_slot_target_index",
    "kl_target_logits",
    "topk_targets",
]
