"""Grouped-query attention of a verify pass on CPU without copying keys and values once per query head.

    route_attention(model)     # a target's SDPA attention → "dfk_gqa_sdpa" (same values, bit for bit)

A target with fewer key/value heads than query heads (GQA: SmolLM2 has 3 for 9) attends each query head to its
group's keys. transformers' SDPA attention hands torch the grouping (`enable_gqa`) only when there is no mask — a
one-token step; with a mask — every verify pass of 2–17 tokens, every tree — it first copies the whole cached K and V
once per query head (`repeat_kv`): on SmolLM2 with 256 cached tokens, 60 copies of 0.6 MB a pass — memory traffic
on top of a pass that is bound by memory already, a visible share of a verify's time. torch's CPU attention takes the
mask and the grouping together and computes each head exactly as on the copies (the same kernel over the same
numbers: `torch.equal`, tests/target/test_attention.py), so on CPU tensors with a mask this attention passes
`enable_gqa` instead; everything else — GPUs (where a mask with `enable_gqa` falls back to the slow math kernel), no
mask, position biases, soft-capping, `output_attentions`, and every call inside `stock_products()` (HF as users run
it, the baselines) — goes to transformers' own `sdpa_attention_forward`. Masks are transformers' SDPA masks
(registered under the same name).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

NAME = "dfk_gqa_sdpa"  # not "dflashkit…": transformers reads any name containing "flash" as a flash-attention kernel


def cpu_gqa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """query (B, H, q, D), key/value (B, H_kv, kv, D), mask (B or 1, 1, q, kv) → (B, q, H, D), as transformers'
    `sdpa_attention_forward` returns it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflashkit.cpu_products import stock_active

    groups = getattr(module, "num_key_value_groups", 1)
    if (
        groups > 1
        and attention_mask is not None
        and query.device.type == "cpu"
        and not stock_active()
        and dropout == 0.0
        and key.shape[-1] == value.shape[-1]
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    ):
        out = F.scaled_dot_product_attention(  # (B, H, q, D)
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None  # (B, q, H, D)
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, cpu_gqa_attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, sdpa_mask)


def route_attention(model: nn.Module) -> bool:
    """Switch a model whose attention is transformers' SDPA to `cpu_gqa_attention`; returns whether it did. A model
    with sub-configs (a vision-language wrapper) or another attention implementation is left as it is."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(config, "sub_configs", None):
        return False  # its vision tower's attention is not ours to change
    if not hasattr(model, "set_attn_implementation"):
        return False
    _register()
    model.set_attn_implementation(NAME)
    return getattr(config, "_attn_implementation", None) == NAME


__all__ = ["NAME", "cpu_gqa_attention", "route_attention"]
