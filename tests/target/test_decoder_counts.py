"""The closed-form parameter counts of the plain dense decoders (`decoder_counts`) equal the meta build's — total,
embeddings, tying and class — over sampled configs of every family it lists (biases on and off, head_dim given,
absent or None, key/value heads given or absent, tied and untied), and a family it does not list is left to the
meta build."""

from __future__ import annotations

import random

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from dflashkit.target.decoder_counts import FAMILIES, closed_form_counts
from dflashkit.target.shape import _meta_text_model


def _sampled(model_type: str, rng: random.Random) -> dict:
    heads = rng.choice([2, 4, 6])
    kv = rng.choice([h for h in (1, 2, heads) if heads % h == 0])
    raw = {
        "model_type": model_type,
        "hidden_size": heads * rng.choice([8, 16]),
        "intermediate_size": rng.choice([24, 40, 64]),
        "num_hidden_layers": rng.choice([1, 2, 3]),
        "num_attention_heads": heads,
        "vocab_size": rng.choice([50, 97, 128]),
        "tie_word_embeddings": rng.random() < 0.5,
        "attention_bias": rng.random() < 0.5,
        "mlp_bias": rng.random() < 0.5,
    }
    if rng.random() < 0.7:
        raw["num_key_value_heads"] = kv
    head_dim = rng.choice(["absent", None, 8, 12])
    if head_dim != "absent":
        raw["head_dim"] = head_dim
    return raw


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_counts_equal_the_meta_build(model_type):
    rng = random.Random(model_type)
    for _ in range(12):
        raw = _sampled(model_type, rng)
        try:
            config = CONFIG_MAPPING[model_type].from_dict(dict(raw))
        except Exception:  # a config transformers refuses (its strict field types) never reaches the counts
            continue
        counts = closed_form_counts(config)
        if getattr(config, "head_dim", 0) is None:  # transformers' own build decides (most refuse it)
            assert counts is None
            continue
        assert counts is not None
        built = _meta_text_model(config, "sampled", trust_remote_code=False)
        assert counts.total == sum(p.numel() for p in built.module.parameters()), raw
        assert counts.embeddings == built.embeddings.weight.numel(), raw
        assert counts.tied == (built.head.weight is built.embeddings.weight), raw
        assert counts.name == built.name, raw


def test_other_families_are_left_to_the_meta_build():
    assert closed_form_counts(CONFIG_MAPPING["qwen3_moe"]()) is None
    assert closed_form_counts(CONFIG_MAPPING["gemma3_text"]()) is None
