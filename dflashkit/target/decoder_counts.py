"""Exact parameter counts of the plain dense decoder families in closed form — the numbers the meta-device build
gives (`target.shape`), without importing their modeling code (about two seconds of every check that reads a shape).

    counts = closed_form_counts(text_config)   # DecoderCounts, or None where only the meta build can count

A family is here only when its parameters are fixed by the config's sizes: embeddings (V, H), per layer the
attention projections (q, k, v: H → heads·d; o: heads·d → H, biases as the family sets them), the gated MLP
(H → I twice, I → H), the RMSNorm weights (two of H per layer, Qwen3's two of d per layer on q and k, one of H after
the last layer), and the LM head (V, H) unless tied. tests/target/test_decoder_counts.py compares every family with
the meta build over sampled configs, so a transformers release that changes a family shows up there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class _Family(NamedTuple):
    causal_lm: str  # the class transformers builds (the shape's architecture where the config names none)
    qkv_bias: str | bool  # the config field that sets the q / k / v biases, or a fixed answer
    o_bias: str | bool  # the same for the output projection
    mlp_bias: str | bool  # the same for the MLP's three projections
    qk_norm: bool  # an RMSNorm of the head dimension on q and on k in every layer


FAMILIES = {
    "llama": _Family("LlamaForCausalLM", "attention_bias", "attention_bias", "mlp_bias", False),
    "mistral": _Family("MistralForCausalLM", False, False, False, False),
    "qwen2": _Family("Qwen2ForCausalLM", True, False, False, False),
    "qwen3": _Family("Qwen3ForCausalLM", "attention_bias", "attention_bias", False, True),
}


@dataclass(frozen=True)
class DecoderCounts:
    """What the meta build of a causal LM says of its parameters."""

    total: int  # every parameter, a tied LM head once
    embeddings: int  # the input table (V × H)
    tied: bool  # the LM head is the input table
    name: str  # the causal LM class transformers builds


def _flag(config: Any, rule: str | bool) -> bool:
    return rule if isinstance(rule, bool) else bool(getattr(config, rule, False))


def closed_form_counts(config: Any) -> DecoderCounts | None:
    """The counts of `config` (a transformers text config), or None when its family is not a plain dense decoder
    listed in FAMILIES, or its head_dim is null — then only the meta build knows."""
    family = FAMILIES.get(getattr(config, "model_type", None))  # type: ignore[arg-type]
    # a head_dim set to null is a build error in most of these families (getattr finds None): the meta build says so
    if family is None or (hasattr(config, "head_dim") and config.head_dim is None):
        return None
    h, v, i = int(config.hidden_size), int(config.vocab_size), int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    d = int(getattr(config, "head_dim", h // heads))
    q_width, kv_width = heads * d, kv * d
    qkv_bias, o_bias, mlp_bias = (_flag(config, r) for r in (family.qkv_bias, family.o_bias, family.mlp_bias))
    attention = h * q_width + 2 * h * kv_width + q_width * h + (q_width + 2 * kv_width) * qkv_bias + h * o_bias
    mlp = 3 * h * i + (2 * i + h) * mlp_bias
    norms = 2 * h + (2 * d if family.qk_norm else 0)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embeddings = v * h
    total = embeddings + int(config.num_hidden_layers) * (attention + mlp + norms) + h + (0 if tied else v * h)
    return DecoderCounts(total=total, embeddings=embeddings, tied=tied, name=family.causal_lm)


__all__ = ["FAMILIES", "DecoderCounts", "closed_form_counts"]
