"""Drafter network: KV-cache inference equals one forward over the whole context; geometry is the drafter's own."""

from __future__ import annotations

import pytest
import torch

from dflashkit.drafter.config import DrafterConfig, default_target_layer_ids
from dflashkit.drafter.model import DFlashDrafter, DrafterCache
from dflashkit.errors import ConfigError


def tiny_config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        vocab_size=50,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        block_size=4,
        mask_token_id=1,
    )
    base.update(kw)
    return DrafterConfig(**base)


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_cached_rounds_equal_single_forward(layer_types, window):
    torch.manual_seed(0)
    cfg = tiny_config(**({"layer_types": layer_types, "sliding_window": window} if layer_types else {}))
    drafter = DFlashDrafter(cfg).eval()
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    feats = torch.randn(1, 10, cfg.num_features * cfg.hidden_size)  # (B, T, K·H)
    bs = cfg.block_size
    cache = DrafterCache()
    # round 1: context 0..6, block at 7..10
    drafter(
        feats[:, :7],
        drafter.block_embeddings(torch.tensor([[4]]), embed, bs),
        context_positions=torch.arange(7)[None],
        block_positions=torch.arange(7, 7 + bs)[None],
        cache=cache,
    )
    assert cache.length == 7
    # round 2: 3 new context tokens 7..9, block at 10..13
    blk = drafter.block_embeddings(torch.tensor([[9]]), embed, bs)
    out_cached = drafter(
        feats[:, 7:],
        blk,
        context_positions=torch.arange(7, 10)[None],
        block_positions=torch.arange(10, 10 + bs)[None],
        cache=cache,
    )
    assert cache.length == 10 and cache.keys[0].shape[2] == 10  # only context K/V are cached
    out_full = drafter(
        feats, blk, context_positions=torch.arange(10)[None], block_positions=torch.arange(10, 10 + bs)[None]
    )
    torch.testing.assert_close(out_cached, out_full, rtol=1e-5, atol=1e-5)
    cache.crop(7)
    assert cache.length == 7 and cache.keys[1].shape[2] == 7


def test_block_is_bidirectional_on_full_layers_and_causal_on_sliding():
    torch.manual_seed(0)
    embed = torch.randn(50, 32)
    feats = torch.randn(1, 6, 96)
    for layer_types, expect_slot0_changes in ((["full_attention"] * 2, True), (["sliding_attention"] * 2, False)):
        cfg = tiny_config(layer_types=layer_types, sliding_window=64)
        drafter = DFlashDrafter(cfg).eval()
        blk = drafter.block_embeddings(torch.tensor([[3]]), embed, 4)
        kw = dict(context_positions=torch.arange(6)[None], block_positions=torch.arange(6, 10)[None])
        a = drafter(feats, blk, **kw)
        blk2 = blk.clone()
        blk2[:, 3] += 1.0  # perturb the last slot
        b = drafter(feats, blk2, **kw)
        assert (not torch.allclose(a[:, 0], b[:, 0])) == expect_slot0_changes


def test_explicit_mask_is_honoured():
    """A dense mask that hides all context must change the output (no path may ignore the mask)."""
    torch.manual_seed(0)
    cfg = tiny_config()
    drafter = DFlashDrafter(cfg).eval()
    feats, blk = torch.randn(1, 5, 96), torch.randn(1, 4, 32)
    kw = dict(context_positions=torch.arange(5)[None], block_positions=torch.arange(5, 9)[None])
    open_mask = torch.ones(1, 1, 4, 9, dtype=torch.bool)
    hide_ctx = open_mask.clone()
    hide_ctx[..., :5] = False
    base = drafter(feats, blk, **kw)
    torch.testing.assert_close(drafter(feats, blk, attention_mask=open_mask, **kw), base)
    no_ctx = drafter(feats, blk, attention_mask=hide_ctx, **kw)
    assert not torch.allclose(no_ctx, base)
    # additive masks are equivalent to boolean ones
    additive = torch.zeros(1, 1, 4, 9).masked_fill(~hide_ctx, float("-inf"))
    torch.testing.assert_close(drafter(feats, blk, attention_mask=additive, **kw), no_ctx)
    # with the context hidden, the context features cannot matter
    torch.testing.assert_close(drafter(feats * 3, blk, attention_mask=hide_ctx, **kw), no_ctx)


def test_fc_reads_all_layers():
    cfg = tiny_config(target_layer_ids=[0, 2, 4, 6, 7])
    drafter = DFlashDrafter(cfg)
    assert drafter.fc.weight.shape == (32, 5 * 32)
    with pytest.raises(ValueError, match="fc reads 5 target layers"):
        drafter.fuse_context(torch.randn(1, 2, 4 * 32))


def test_learned_mask_embedding_fills_slots():
    cfg = tiny_config(learned_mask_embedding=True, mask_token_id=0)
    drafter = DFlashDrafter(cfg)
    embed = torch.randn(50, 32)
    blk = drafter.block_embeddings(torch.tensor([[7, 8]]), embed, 4)  # (1, 8, 32)
    torch.testing.assert_close(blk[0, 0], embed[7])
    torch.testing.assert_close(blk[0, 4], embed[8])
    for slot in (1, 2, 3, 5, 6, 7):
        torch.testing.assert_close(blk[0, slot], drafter.mask_embedding.detach())


def test_default_layer_ids_zlab_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(64, 5)[-1] == 61
    ids = default_target_layer_ids(30, 5)
    assert ids[0] == 1 and ids[-1] == 27 and len(set(ids)) == 5


def test_geometry_is_the_drafters_own():
    """A target with head_dim 256 / 24 heads (hidden 3072) must not pass its attention geometry on."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.target.model import Target

    tcfg = Qwen3Config(
        vocab_size=1000,
        hidden_size=3072,
        intermediate_size=64,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
    )
    with torch.device("meta"):
        target = Target(Qwen3ForCausalLM(tcfg))
    cfg = default_drafter_config(target)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 32, 8)
    assert cfg.hidden_size == 3072 and cfg.vocab_size == 1000
    assert cfg.target_layer_ids == default_target_layer_ids(28, 5)
    assert cfg.learned_mask_embedding  # no tokenizer → no known spare row → learned mask


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(target_layer_ids=[1, 8]), "out of range"),
        (dict(target_layer_ids=[1, 1, 2]), "duplicates"),
        (dict(mask_token_id=50), r"mask_token_id = 50: expected a row of the embedding table: 0 ≤ id < vocab_size 50"),
        (dict(num_attention_heads=3), "multiple of"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (dict(layer_types=["full_attention"]), "one entry per layer: num_hidden_layers = 2"),
    ],
)
def test_bad_config_fields(bad, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**bad)
