"""Exact attention under a block-sparse training mask: the queries in tiles, each over only the keys its rows can see.

    tiled = tile_mask(mask, torch.float32)             # bool (B, 1, Nq, Tc + Nq) → TiledMask, once per step
    out = tiled_attention(q, k, v, tiled, scale=…)     # == SDPA(q, k, v, additive mask) within float rounding

A training step's mask is mostly invisible: a block's queries see their document's context before the anchor and
their own block, so in the dense (Nq, Tc + Nq) score matrix — Nq ≈ 2·Tc when every anchor of a packed row is
drafted — about a block size's worth of the Nq block columns is visible per row, and only its document's span of the
context. The dense form pays for every column, forward and backward. Here the query axis is cut into tiles of
`tile` rows; each tile attends over the span [first, last visible] of the context columns and the span of the block
columns its rows see, read from the mask itself (no assumption about which masks training builds). A column
outside those spans is masked for every row of the tile, so it adds exp(min − max) = 0 to the softmax: the result
is the dense one, up to the order of the sums. A tile holding a row that sees no key at all (a padding block)
attends over every column, as the dense form does, so even those rows equal it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# Queries per tile: smaller tiles follow the documents' spans more closely, larger ones pay less per-call overhead;
# 128 keeps a tile's span within about one packed document for rows of ~1,000 tokens.
DEFAULT_TILE = 128


@dataclass
class TiledMask:
    """A boolean attention mask cut into query tiles, each with the key spans its rows can see and its additive mask
    over those keys."""

    tiles: list[tuple[int, int, list[tuple[int, int]]]]  # (q0, q1, [(k0, k1), …]) key spans in column order
    additive: list[Tensor]  # per tile (B, 1, q1 − q0, Σ spans) in the attention dtype
    key_length: int  # Tc + Nq, the dense mask's key axis
    index: Tensor  # (Σ tiles' keys,) long: every tile's key columns, tile after tile


def _spans(cols: Tensor, lo: int, hi: int) -> Tensor:
    """cols (n, Tk) bool → (n, 2) long: the first and one past the last True column in [lo, hi) per row (lo, lo
    where none)."""
    idx = torch.arange(lo, hi, device=cols.device)  # (hi − lo,)
    part = cols[:, lo:hi]
    first = torch.where(part, idx, hi).amin(-1)
    last = torch.where(part, idx + 1, lo).amax(-1)
    return torch.stack([torch.where(first < last, first, lo), torch.where(first < last, last, lo)], -1)


def tile_mask(mask: Tensor, dtype: torch.dtype, *, tile: int = DEFAULT_TILE) -> TiledMask:
    """mask: bool (B, 1, Nq, Tc + Nq), True = may attend, the block keys last → a TiledMask in `dtype`."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"tile_mask needs a boolean (B, 1, Nq, Tk) mask, got {mask.dtype} {tuple(mask.shape)}")
    b, _, nq, tk = mask.shape
    tc = tk - nq
    if tc < 0 or tile < 1:
        raise ValueError(f"a (B, 1, {nq}, {tk}) mask has no context columns before its {nq} block columns")
    n = -(-nq // tile)
    vis = F.pad(mask[:, 0], (0, 0, 0, n * tile - nq))  # (B, n·tile, Tk), padding rows see nothing
    cols = vis.view(b, n, tile, tk).any(2).any(0)  # (n, Tk): columns some row of the tile sees
    rows = vis.any(-1).view(b, n, tile)  # (B, n, tile)
    real = (torch.arange(n * tile, device=mask.device) < nq).view(n, tile)
    blind = ((~rows) & real).any(-1).any(0)  # (n,): a tile with a row that sees nothing
    spans = torch.cat([_spans(cols, 0, tc), _spans(cols, tc, tk)], -1).tolist()  # (n, 4)
    tiles, additive = [], []
    neg = torch.finfo(dtype).min
    for i, (c0, c1, k0, k1) in enumerate(spans):
        q0, q1 = i * tile, min(nq, (i + 1) * tile)
        keys = [(0, tk)] if bool(blind[i]) else [(a, z) for a, z in ((c0, c1), (k0, k1)) if z > a]
        part = torch.cat([mask[:, :, q0:q1, a:z] for a, z in keys], -1)  # (B, 1, q1 − q0, Σ spans)
        tiles.append((q0, q1, keys))
        additive.append(torch.zeros(part.shape, dtype=dtype, device=mask.device).masked_fill_(~part, neg))
    index = torch.cat([torch.arange(a, z, device=mask.device) for _, _, keys in tiles for a, z in keys])
    return TiledMask(tiles, additive, tk, index)


def widest_tiles(rows: int, queries: int, context: int, dtype: torch.dtype, *, tile: int = DEFAULT_TILE) -> TiledMask:
    """The TiledMask of a step whose every query tile sees its row's whole context and its own blocks' keys — the
    widest a training mask's tiles get (one document filling the row) — for shapes alone (fake tensors: memory)."""
    tiles, additive = [], []
    for q0 in range(0, queries, tile):
        q1 = min(queries, q0 + tile)
        tiles.append((q0, q1, [(0, context), (context + q0, context + q1)]))
        additive.append(torch.zeros(rows, 1, q1 - q0, context + q1 - q0, dtype=dtype))
    index = torch.cat([torch.arange(a, z) for _, _, keys in tiles for a, z in keys])
    return TiledMask(tiles, additive, context + queries, index)


def widest_tiles_bytes(rows: int, queries: int, context: int, itemsize: int, *, tile: int = DEFAULT_TILE) -> int:
    """Bytes of `widest_tiles(rows, queries, context, …).additive`, in closed form (any size, nothing built): a tile
    of q rows holds (rows, 1, q, context + q) entries, so the tiles sum to rows · (queries · context + Σ q²)."""
    full, last = divmod(queries, tile)
    return rows * itemsize * (queries * context + full * tile * tile + last * last)


# Its tiles are data: a compiled drafter runs it eagerly instead of recompiling every step. The eager form is made by
# `compile_ready`, not at import: `torch.compiler.disable` imports dynamo, a second of every command's start.
_EAGER: list[Any] = []


def compile_ready() -> None:
    """Call before torch.compile of a drafter: makes the form a compiled graph calls (`tiled_attention` run eagerly)."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_tiled_attention))


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, tiled: TiledMask, *, scale: float, enable_gqa: bool) -> Tensor:
    """q (B, nh, Nq, d), k / v (B, kvh, Tk, d) → (B, nh, Nq, d): SDPA under the mask `tiled` was cut from."""
    if torch.compiler.is_compiling() and _EAGER:  # without compile_ready a compiled graph traces the tiles
        return _EAGER[0](q, k, v, tiled, scale=scale, enable_gqa=enable_gqa)
    return _tiled_attention(q, k, v, tiled, scale=scale, enable_gqa=enable_gqa)


def _tiled_attention(q: Tensor, k: Tensor, v: Tensor, tiled: TiledMask, *, scale: float, enable_gqa: bool) -> Tensor:
    if k.shape[2] != tiled.key_length:
        raise ValueError(f"keys of length {k.shape[2]} under a mask over {tiled.key_length} keys")
    # one gather and one split per tensor: their backward is one scatter-add and one concatenation, where slicing
    # per tile would add a zero-filled full-size gradient for every tile
    # scores and softmax in float32 at least: under bf16 autocast the products around the attention stay bf16, but
    # a softmax over hundreds of keys is where bf16's 8 bits would show (and CPU kernels work in float32 anyway)
    dtype = torch.promote_types(q.dtype, torch.float32)
    sizes = [sum(z - a for a, z in spans) for _, _, spans in tiled.tiles]
    ks = k.to(dtype).index_select(2, tiled.index).split(sizes, 2)  # per tile (B, kvh, Σ spans, d)
    vs = v.to(dtype).index_select(2, tiled.index).split(sizes, 2)
    qs = q.to(dtype).split([q1 - q0 for q0, q1, _ in tiled.tiles], 2)  # per tile (B, nh, q1 − q0, d)
    # autocast off where the device has one (the meta device of shape-only memory traces has none)
    device = q.device.type
    with torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device) else contextlib.nullcontext():
        outs = [
            F.scaled_dot_product_attention(qt, kt, vt, attn_mask=add.to(dtype), scale=scale, enable_gqa=enable_gqa)
            for qt, kt, vt, add in zip(qs, ks, vs, tiled.additive, strict=True)
        ]  # per tile (B, nh, q1 − q0, d)
    return torch.cat(outs, 2).to(q.dtype)


__all__ = [
    "DEFAULT_TILE",
    "TiledMask",
    "compile_ready",
    "tile_mask",
    "tiled_attention",
    "widest_tiles",
    "widest_tiles_bytes",
]
