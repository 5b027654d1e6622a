"""Tiled attention (dflashkit.drafter.tiled_attention) against the dense SDPA it replaces on CPU: outputs and
gradients in float64 on training masks of packed rows (several documents, padding blocks, causal blocks, sliding
windows), a mask with a row that sees nothing, and the drafter's training forward and loss end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit.drafter.model import DFlashDrafter, to_additive
from dflashkit.drafter.tiled_attention import tile_mask, tiled_attention, widest_tiles, widest_tiles_bytes
from dflashkit.train.blocks import build_blocks, dense_mask, masks_for_layer_types, sample_anchors
from dflashkit.train.losses import block_loss
from tests.train.test_blocks import _batch_with_padding, packed_row, tiny_config


def _qkv(b: int, nq: int, tk: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, nq, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, tk, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, tk, 8, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _both(mask: torch.Tensor, tile: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dense output and q/k/v gradients, tiled output and gradients) under `mask` (bool (B, 1, Nq, Tk))."""
    b, _, nq, tk = mask.shape
    out = []
    for tiled in (False, True):
        q, k, v = _qkv(b, nq, tk, seed)
        if tiled:
            o = tiled_attention(q, k, v, tile_mask(mask, torch.float64, tile=tile), scale=0.3, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=to_additive(mask, torch.float64), scale=0.3, enable_gqa=True
            )
        o.backward(torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view_as(o))
        out.append([o.detach(), q.grad, k.grad, v.grad])
    return out[0], out[1]


@pytest.mark.parametrize("tile", [1, 4, 8, 13, 64])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 3), (True, 5)])
def test_tiled_equals_dense_on_training_masks(tile: int, causal: bool, window: int | None) -> None:
    for seed in range(2):
        _, batch = _batch_with_padding(seed, 4)  # two rows, different anchor counts: padding blocks
        mask = dense_mask(batch, causal_in_block=causal, window=window)
        dense, tiled = _both(mask, tile, seed)
        for a, b in zip(dense, tiled, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_tiles_read_only_the_columns_their_rows_see() -> None:
    """Each tile's spans cover every visible column of its rows, and a row of many documents reads far fewer keys
    than the dense (Nq, Tc + Nq) matrix."""
    rows = [packed_row(s, t=96) for s in (3, 4)]
    stacked = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    g = torch.Generator().manual_seed(0)
    anchors = [sample_anchors(r["doc_ids"], r["loss_mask"], max_anchors=64, generator=g) for r in rows]
    batch = build_blocks(**stacked, block_size=4, anchors=anchors)
    mask = dense_mask(batch, causal_in_block=False, window=None)
    tiled = tile_mask(mask, torch.float32, tile=8)
    seen = 0
    for (q0, q1, spans), add in zip(tiled.tiles, tiled.additive, strict=True):
        inside = torch.zeros(mask.shape[-1], dtype=torch.bool)
        for a, z in spans:
            inside[a:z] = True
        assert not mask[:, :, q0:q1, ~inside].any(), "a visible column outside the tile's spans"
        visible = torch.cat([mask[:, :, q0:q1, a:z] for a, z in spans], -1)
        assert torch.equal(add == 0, visible)
        seen += (q1 - q0) * int(inside.sum())
    assert seen < 0.5 * mask.shape[2] * mask.shape[3]


def test_a_tile_with_a_row_that_sees_nothing_attends_over_every_key() -> None:
    """A fully masked row averages every value under the dense additive mask; its tile keeps all keys so it still
    does (the other tiles stay narrow)."""
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(1, 1, 12, 20, generator=g) > 0.7
    mask[..., 5, :] = False
    mask[..., 9, :] = False
    mask[..., 9, 3] = True
    tiled = tile_mask(mask, torch.float64, tile=4)
    assert tiled.tiles[1][2] == [(0, 20)]
    dense, out = _both(mask, 4)
    for a, b in zip(dense, out, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_widest_tiles_shapes() -> None:
    tiled = widest_tiles(2, 10, 7, torch.bfloat16, tile=4)
    assert [t[:2] for t in tiled.tiles] == [(0, 4), (4, 8), (8, 10)]
    assert tiled.tiles[1][2] == [(0, 7), (11, 15)]
    assert [tuple(m.shape) for m in tiled.additive] == [(2, 1, 4, 11), (2, 1, 4, 11), (2, 1, 2, 9)]
    assert tiled.index.numel() == 11 + 11 + 9 and tiled.key_length == 17
    with torch.device("meta"):  # the closed form the memory model reads, against the tiles themselves
        for rows, queries, context, tile in ((2, 10, 7, 4), (1, 640, 300, 128), (3, 1000, 77, 128), (1, 5, 9, 128)):
            made = sum(m.nbytes for m in widest_tiles(rows, queries, context, torch.float32, tile=tile).additive)
            assert widest_tiles_bytes(rows, queries, context, 4, tile=tile) == made


def test_bad_masks_are_refused() -> None:
    with pytest.raises(ValueError, match="boolean"):
        tile_mask(torch.zeros(1, 1, 4, 8), torch.float32)
    with pytest.raises(ValueError, match="no context columns"):
        tile_mask(torch.ones(1, 1, 8, 4, dtype=torch.bool), torch.float32)
    tiled = tile_mask(torch.ones(1, 1, 4, 8, dtype=torch.bool), torch.float32)
    q, k, v = _qkv(1, 4, 9, 0)
    with pytest.raises(ValueError, match="keys of length 9"):
        tiled_attention(q, k, v, tiled, scale=1.0, enable_gqa=True)


@pytest.mark.parametrize("cfg_kw", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}])
def test_drafter_training_forward_loss_and_gradients_equal_the_dense_path(cfg_kw: dict) -> None:
    """The drafter's forward over a packed batch, its block loss and every parameter's gradient: tiled masks (CPU
    training) == dense additive masks, in float64."""
    _, batch = _batch_with_padding(5, 4)
    cfg = tiny_config(**cfg_kw)
    results = []
    for tiled in (False, True):
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg).double().train()
        g = torch.Generator().manual_seed(1)
        feats = torch.randn(batch.batch_size, batch.context_len, 2 * 32, generator=g, dtype=torch.float64)
        head = torch.randn(50, 32, generator=g, dtype=torch.float64)
        bool_masks = masks_for_layer_types(cfg, batch)
        masks = {
            k: tile_mask(m, torch.float64, tile=4) if tiled else to_additive(m, torch.float64)
            for k, m in bool_masks.items()
        }
        embeds = drafter.block_embeddings(batch.first_tokens, head, 4)
        hidden = drafter(
            feats, embeds, context_positions=batch.context_positions, block_positions=batch.block_positions,
            attention_mask=masks, block_len=4,
        )  # fmt: skip
        loss = block_loss(hidden.reshape(-1, 4, 32), head, batch.labels.reshape(-1, 4)).loss
        loss.backward()
        results.append([hidden.detach(), loss.detach(), *[p.grad for p in drafter.parameters()]])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_under_torch_compile_it_runs_eagerly_once_made_ready() -> None:
    """A compiled caller runs tiled attention eagerly (its tiles are data: outside the graph, not a graph per mask);
    importing it does not import dynamo, so the eager form is made by `compile_ready`."""
    import subprocess
    import sys

    from dflashkit.drafter import tiled_attention as ta

    code = "import sys, dflashkit.drafter.tiled_attention; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
    torch.manual_seed(0)
    mask = torch.rand(1, 1, 8, 12) > 0.4
    mask[..., 0] = True
    tiled = tile_mask(mask, torch.float32, tile=4)
    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 12, 4), torch.randn(1, 2, 12, 4)
    fn = lambda q, k, v: tiled_attention(q, k, v, tiled, scale=0.5, enable_gqa=False) * 2  # noqa: E731
    torch._dynamo.reset()
    ta.compile_ready()
    assert ta._EAGER and getattr(ta._EAGER[0], "_torchdynamo_disable", False)
    try:
        explained = torch._dynamo.explain(fn)(q, k, v)
        assert explained.op_count <= 2  # only `* 2`: the tiles ran outside the graph
        assert torch.equal(torch.compile(fn, backend="eager")(q, k, v), fn(q, k, v))
    finally:
        torch._dynamo.reset()
