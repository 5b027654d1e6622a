"""Training blocks for DFlash: anchor sampling, block inputs/labels, and the training attention masks.

A training row is a packed sequence of T tokens that may hold several documents, described by
`doc_ids` (T,) (−1 = padding), `positions` (T,) (0.. within each document) and `loss_mask` (T,) (supervised
assistant tokens). The target's features for all T tokens are the drafter's context.

Anchors
    Index a is a candidate when loss_mask[a] and loss_mask[a+1] hold and doc_ids[a] == doc_ids[a+1] ≥ 0.
    Up to `max_anchors` candidates per document are drawn uniformly without replacement (torch.Generator; the
    caller reseeds every epoch) and sorted by index.

Blocks
    Anchor a of document d gives bs slots; slot k has position positions[a] + k and label input_ids[a + k].
    Slot 0's input is the clean token at a, slots 1..bs−1 are MASK (see `DFlashDrafter.block_embeddings`).
    A label is valid when index a + k is inside the row, in document d, at position positions[a] + k (so the
    tail of a block running past its document's end is invalid, label −100) and — with `label_loss_mask`
    (default, as SpecForge does) — loss_mask[a + k] holds. Rows with fewer anchors than the batch's widest row
    are padded with anchor −1: such blocks get document −1, positions 0..bs−1, first token 0, no valid label,
    and attend to their own block only.

Attention (keys = [T context keys | Nb·bs block keys], queries = the Nb·bs block slots)
    A slot of block (anchor a, document d) sees context key j iff doc_ids[j] == d and positions[j] <
    positions[a] (strict, by position); it sees the keys of its own block (all of them, or key slot ≤ query slot
    with `causal_in_block`) and no other block. With a window W: query position − key position < W (and, when
    not causal, key − query < W too, matching `model.positional_mask` at inference). Every slot sees itself.

Three builders of the same mask: `reference_mask` (plain Python loops, for tests), `dense_mask` (vectorised bool
(B, 1, Nq, T + Nq) for SDPA) and `flex_mask_mod` / `flex_block_mask` (FlexAttention on CUDA); all three share
nothing but the definition above. `masks_for_layer_types` builds one mask per layer type of a drafter config;
`attention_masks` is what a training step hands the drafter (CUDA: flex block masks; CPU: the dense mask cut into
query tiles, `drafter.tiled_attention`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.tiled_attention import tile_mask
from dflashkit.errors import DataError

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------------- anchors
def candidate_anchors(doc_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """Indices a with loss_mask[a] & loss_mask[a+1] & doc_ids[a] == doc_ids[a+1] ≥ 0. (T,), (T,) → (n,) long."""
    if doc_ids.dim() != 1 or loss_mask.shape != doc_ids.shape:
        raise DataError(
            f"doc_ids and loss_mask must be 1-D of equal length, got {tuple(doc_ids.shape)} "
            f"and {tuple(loss_mask.shape)}"
        )
    lm = loss_mask.bool()
    ok = lm[:-1] & lm[1:] & (doc_ids[:-1] == doc_ids[1:]) & (doc_ids[:-1] >= 0)  # (T−1,)
    return ok.nonzero().flatten()


def sample_anchors(
    doc_ids: Tensor, loss_mask: Tensor, *, max_anchors: int = 512, generator: torch.Generator | None = None
) -> Tensor:
    """Up to `max_anchors` candidates per document, uniformly without replacement, sorted. → (n,) long."""
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be ≥ 1, got {max_anchors}")
    cand = candidate_anchors(doc_ids, loss_mask)  # (n,)
    cand_docs = doc_ids[cand]
    rng_device = generator.device if generator is not None else torch.device("cpu")
    picked = []
    for d in torch.unique(cand_docs).tolist():
        mine = cand[cand_docs == d]  # (n_d,)
        if mine.numel() > max_anchors:
            perm = torch.randperm(mine.numel(), generator=generator, device=rng_device)[:max_anchors]
            mine = mine[perm.to(mine.device)]
        picked.append(mine)
    if not picked:
        return cand.new_empty(0)
    return torch.cat(picked).sort().values


# ---------------------------------------------------------------------------------------------- blocks
@dataclass
class BlockBatch:
    """All blocks of B packed rows (Nb blocks per row, anchor −1 = padding block). Nq = Nb·bs."""

    block_size: int
    anchors: Tensor  # (B, Nb) long, −1 for padding blocks
    first_tokens: Tensor  # (B, Nb) long: input token at the anchor (0 for padding) → block_embeddings
    anchor_positions: Tensor  # (B, Nb) long: positions[anchor] (0 for padding)
    block_doc_ids: Tensor  # (B, Nb) long: document of the anchor (−1 for padding)
    block_positions: Tensor  # (B, Nq) long: positions[anchor] + k (k for padding) → block RoPE positions
    labels: Tensor  # (B, Nb, bs) long: input_ids[anchor + k], −100 where not valid
    label_valid: Tensor  # (B, Nb, bs) bool
    context_doc_ids: Tensor  # (B, T) long
    context_positions: Tensor  # (B, T) long → context RoPE positions

    @property
    def batch_size(self) -> int:
        return int(self.anchors.shape[0])

    @property
    def num_blocks(self) -> int:
        return int(self.anchors.shape[1])

    @property
    def num_queries(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def context_len(self) -> int:
        return int(self.context_doc_ids.shape[1])

    @property
    def block_valid(self) -> Tensor:
        """(B, Nb) bool: real (non-padding) blocks."""
        return self.anchors >= 0

    def to(self, device: torch.device | str) -> BlockBatch:
        values: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        return BlockBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})


def _as_rows(x: Tensor, name: str) -> Tensor:
    if x.dim() == 1:
        return x[None]
    if x.dim() != 2:
        raise DataError(f"{name} must be (T,) or (B, T), got shape {tuple(x.shape)}")
    return x


def _pad_anchors(rows: Sequence[Tensor], num_blocks: int | None, device: torch.device) -> Tensor:
    width = max([int(r.numel()) for r in rows] + [0])
    if num_blocks is not None:
        if num_blocks < width:
            raise DataError(f"num_blocks={num_blocks} but a row has {width} anchors")
        width = num_blocks
    out = torch.full((len(rows), width), -1, dtype=torch.long, device=device)  # (B, Nb)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.to(device=device, dtype=torch.long).flatten()
    return out


def build_blocks(
    input_ids: Tensor,
    doc_ids: Tensor,
    positions: Tensor,
    loss_mask: Tensor,
    *,
    block_size: int,
    anchors: Tensor | Sequence[Tensor],
    num_blocks: int | None = None,
    label_loss_mask: bool = True,
) -> BlockBatch:
    """Blocks for one row ((T,) inputs) or a batch ((B, T) inputs).

    anchors: a (B, Nb) / (Nb,) tensor with −1 padding, or one 1-D tensor per row (any index whose doc_ids ≥ 0 is
    accepted, candidate or not; `sample_anchors` draws them).
    num_blocks: pad every row to this many blocks (fixed shapes for compiled kernels).
    label_loss_mask: also require loss_mask at the label's index for the label to be valid.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    ids, docs = _as_rows(input_ids, "input_ids"), _as_rows(doc_ids, "doc_ids").long()
    pos, lm = _as_rows(positions, "positions").long(), _as_rows(loss_mask, "loss_mask").bool()
    if not ids.shape == docs.shape == pos.shape == lm.shape:
        raise DataError(
            f"input_ids {tuple(ids.shape)}, doc_ids {tuple(docs.shape)}, positions {tuple(pos.shape)} "
            f"and loss_mask {tuple(lm.shape)} must have the same shape"
        )
    b, t = ids.shape
    device = ids.device
    if isinstance(anchors, Tensor):
        a2 = anchors[None] if anchors.dim() == 1 else anchors
        if a2.dim() != 2 or a2.shape[0] != b:
            raise DataError(f"anchors must be (Nb,) or ({b}, Nb), got {tuple(anchors.shape)}")
        rows = list(a2)
    else:
        rows = list(anchors)
        if len(rows) != b:
            raise DataError(f"got anchors for {len(rows)} rows, expected {b}")
    anc = _pad_anchors(rows, num_blocks, device)  # (B, Nb)
    valid = anc >= 0  # (B, Nb)
    if bool((anc >= t).any()):
        raise DataError(f"an anchor index is ≥ the row length {t}")
    ac = anc.clamp(min=0)  # (B, Nb)
    block_doc = torch.where(valid, docs.gather(1, ac), -1)  # (B, Nb)
    if bool((valid & (block_doc < 0)).any()):
        raise DataError("an anchor points at a padding token (doc_ids −1)")
    anchor_pos = torch.where(valid, pos.gather(1, ac), 0)  # (B, Nb)
    first = torch.where(valid, ids.gather(1, ac), 0)  # (B, Nb)

    nb = anc.shape[1]
    k = torch.arange(block_size, device=device)  # (bs,)
    idx = ac[:, :, None] + k  # (B, Nb, bs)
    idx_c = idx.clamp(max=t - 1).reshape(b, nb * block_size)  # (B, Nq)
    same_doc = docs.gather(1, idx_c).view(b, nb, block_size) == block_doc[:, :, None]
    in_seq = pos.gather(1, idx_c).view(b, nb, block_size) == anchor_pos[:, :, None] + k
    label_valid = valid[:, :, None] & (idx < t) & same_doc & in_seq  # (B, Nb, bs)
    if label_loss_mask:
        label_valid &= lm.gather(1, idx_c).view(b, nb, block_size)
    labels = torch.where(label_valid, ids.gather(1, idx_c).view(b, nb, block_size).long(), -100)
    slot_pos = torch.where(valid[:, :, None], anchor_pos[:, :, None] + k, k)  # (B, Nb, bs)
    return BlockBatch(
        block_size=block_size,
        anchors=anc,
        first_tokens=first.long(),
        anchor_positions=anchor_pos,
        block_doc_ids=block_doc,
        block_positions=slot_pos.reshape(b, nb * block_size),
        labels=labels,
        label_valid=label_valid,
        context_doc_ids=docs,
        context_positions=pos,
    )


# ---------------------------------------------------------------------------------------------- masks
def _query_key_tensors(batch: BlockBatch) -> tuple[list[Tensor], list[Tensor]]:
    """Per-query (B, Nq) and per-key (B, T + Nq) descriptors: doc, anchor position / position, block, slot."""
    b, bs, nq, t = batch.batch_size, batch.block_size, batch.num_queries, batch.context_len
    device = batch.anchors.device
    q_doc = batch.block_doc_ids.repeat_interleave(bs, dim=1)  # (B, Nq)
    q_anchor = batch.anchor_positions.repeat_interleave(bs, dim=1)  # (B, Nq)
    q_pos = batch.block_positions  # (B, Nq)
    q_block = (torch.arange(nq, device=device) // bs).expand(b, nq)  # (B, Nq)
    q_slot = (torch.arange(nq, device=device) % bs).expand(b, nq)  # (B, Nq)
    k_doc = torch.cat([batch.context_doc_ids, torch.full_like(q_doc, -2)], dim=1)  # (B, T + Nq)
    k_pos = torch.cat([batch.context_positions, q_pos], dim=1)  # (B, T + Nq)
    k_block = torch.cat([torch.full((b, t), -1, device=device, dtype=torch.long), q_block], dim=1)
    k_slot = torch.cat([torch.zeros((b, t), device=device, dtype=torch.long), q_slot], dim=1)
    return [q_doc, q_anchor, q_pos, q_block, q_slot], [k_doc, k_pos, k_block, k_slot]


def _visible(q: Sequence[Tensor], k: Sequence[Tensor], causal_in_block: bool, window: int | None) -> Tensor:
    """Elementwise visibility of key k for query q (broadcasting); the one definition dense and flex share."""
    q_doc, q_anchor, q_pos, q_block, q_slot = q
    k_doc, k_pos, k_block, k_slot = k
    ctx = (k_block < 0) & (q_doc >= 0) & (k_doc == q_doc) & (k_pos < q_anchor)
    own = k_block == q_block
    if causal_in_block:
        own = own & (k_slot <= q_slot)
    vis = ctx | own
    if window is not None:
        diff = q_pos - k_pos
        vis = vis & (diff < window)
        if not causal_in_block:
            vis = vis & (-diff < window)
    return vis


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be ≥ 1 or None, got {window}")


def dense_mask(batch: BlockBatch, *, causal_in_block: bool = False, window: int | None = None) -> Tensor:
    """Bool (B, 1, Nq, T + Nq) mask over [context keys | block keys], True = visible."""
    _check_window(window)
    q, k = _query_key_tensors(batch)
    vis = _visible([x[:, :, None] for x in q], [x[:, None, :] for x in k], causal_in_block, window)  # (B, Nq, K)
    return vis[:, None]


def flex_mask_mod(batch: BlockBatch, *, causal_in_block: bool = False, window: int | None = None) -> MaskMod:
    """A FlexAttention `mask_mod(b, h, q_idx, kv_idx)` for this batch (Q_LEN = Nq, KV_LEN = T + Nq)."""
    _check_window(window)
    q, k = _query_key_tensors(batch)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return _visible([x[b, q_idx] for x in q], [x[b, kv_idx] for x in k], causal_in_block, window)

    return mask_mod


def flex_block_mask(
    batch: BlockBatch,
    *,
    causal_in_block: bool = False,
    window: int | None = None,
    device: torch.device | str | None = None,
    tile: int = 128,
    compile_mask: bool = False,
) -> Any:
    """`torch.nn.attention.flex_attention.create_block_mask` for this batch (a BlockMask; CUDA in training)."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = device if device is not None else batch.anchors.device
    return create_block_mask(
        flex_mask_mod(batch.to(device), causal_in_block=causal_in_block, window=window),
        B=batch.batch_size,
        H=None,
        Q_LEN=batch.num_queries,
        KV_LEN=batch.context_len + batch.num_queries,
        device=device,
        BLOCK_SIZE=tile,
        _compile=compile_mask,
    )


def masks_for_layer_types(config: DrafterConfig, batch: BlockBatch, *, backend: str = "dense") -> dict[str, Any]:
    """One mask per layer type present in `config` ("full_attention" / "sliding_attention"), for the drafter's
    `attention_mask` argument. backend "dense" → bool tensors; "flex" → BlockMasks."""
    if backend not in ("dense", "flex"):
        raise ValueError(f"backend must be 'dense' or 'flex', got {backend!r}")
    out: dict[str, Any] = {}
    for i, layer_type in enumerate(config.layer_types):
        if layer_type in out:
            continue
        causal, window = config.layer_is_causal(i), config.layer_window(i)
        build = dense_mask if backend == "dense" else flex_block_mask
        out[layer_type] = build(batch, causal_in_block=causal, window=window)
    return out


def attention_masks(drafter_config: Any, blocks: BlockBatch, dtype: torch.dtype) -> dict[str, Any]:
    """Training mask per layer type: flex-attention BlockMasks on CUDA (sparse, no dense (Nq, T + Nq) tensor),
    elsewhere the dense boolean mask cut into query tiles over the keys they see (`tile_mask`: additive, in the
    attention dtype). Both are tested against the same naive reference (tests/train/test_blocks.py)."""
    if blocks.anchors.device.type == "cuda":
        return masks_for_layer_types(drafter_config, blocks, backend="flex")
    return {k: tile_mask(m, dtype) for k, m in masks_for_layer_types(drafter_config, blocks).items()}


def reference_mask(
    doc_ids: Sequence[int] | Tensor,
    positions: Sequence[int] | Tensor,
    anchors: Sequence[int] | Tensor,
    block_size: int,
    *,
    causal_in_block: bool = False,
    window: int | None = None,
) -> Tensor:
    """Naive loop version of the mask for one row: bool (Nq, T + Nq). Anchor −1 = padding block."""
    docs = [int(x) for x in (doc_ids.tolist() if isinstance(doc_ids, Tensor) else doc_ids)]
    pos = [int(x) for x in (positions.tolist() if isinstance(positions, Tensor) else positions)]
    anc = [int(x) for x in (anchors.tolist() if isinstance(anchors, Tensor) else anchors)]
    t, bs = len(docs), block_size
    nq = len(anc) * bs
    mask = torch.zeros(nq, t + nq, dtype=torch.bool)
    for qi in range(len(anc)):
        a = anc[qi]
        for qs in range(bs):
            row = qi * bs + qs
            q_pos = pos[a] + qs if a >= 0 else qs
            if a >= 0:
                for j in range(t):
                    same_doc_before = docs[j] == docs[a] and pos[j] < pos[a]
                    if same_doc_before and (window is None or q_pos - pos[j] < window):
                        mask[row, j] = True
            for ks in range(bs):
                if causal_in_block and ks > qs:
                    continue
                if window is not None and (qs - ks >= window or (not causal_in_block and ks - qs >= window)):
                    continue
                mask[row, t + qi * bs + ks] = True
    return mask
