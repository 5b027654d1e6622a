"""A target's GQA attention on CPU without per-head copies of K/V (target/attention.py): the same logits bit for bit
as transformers' SDPA attention — a verify pass over a cache, a tree's additive mask, a padded batch — on Llama and
Qwen3; transformers' own path inside `stock_products()` (the HF baselines) and where it does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit.cpu_products.products import stock_products
from dflashkit.target import attention
from dflashkit.target.model import Target
from helpers.choices import set_choice


@pytest.fixture
def gqa_calls(monkeypatch):
    """How many SDPA calls passed `enable_gqa=True` with a mask (the copy-free route)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa")) and kwargs.get("attn_mask") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    set_choice(monkeypatch, "products", "stock")  # the same linears in both runs
    return calls


def _passes(t: Target) -> list[torch.Tensor]:
    """Logits of a prefill, a 5-token verify over the cache, a 4-node tree and a padded batch of two."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (1, 24), generator=g)
    cache = t.new_cache()
    out = [t.forward(ids, cache=cache, use_cache=True).logits]
    out.append(t.forward(torch.randint(3, 97, (1, 5), generator=g), cache=cache, use_cache=True).logits)
    start = 29  # the tree's root after 29 cached tokens: nodes 0 ← 1 ← 2 and 0 ← 3
    allowed = torch.ones(4, start + 4, dtype=torch.bool)
    allowed[:, start:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    bias = torch.zeros(1, 1, 4, start + 4).masked_fill_(~allowed[None, None], torch.finfo(torch.float32).min)
    tree = torch.randint(3, 97, (1, 4), generator=g)
    positions = torch.tensor([[start, start + 1, start + 2, start + 1]])
    out.append(
        t.forward(tree, cache=cache, use_cache=True, position_ids=positions, attention_mask=bias).logits  # (1, 4, V)
    )
    batch = torch.randint(3, 97, (2, 9), generator=g)
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, :3] = 0  # left padding, as batched regeneration has
    with torch.no_grad():
        out.append(t.model(input_ids=batch, attention_mask=pad, cache=t.new_cache()).logits)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_same_logits_bit_for_bit_as_transformers_sdpa(tiny_target_dirs, gqa_calls, kind):
    t = Target.load(tiny_target_dirs[kind])
    assert t.model.config._attn_implementation == attention.NAME
    with torch.no_grad():
        got = _passes(t)
        routed = sum(gqa_calls)
        with stock_products():  # transformers' own SDPA attention (repeat_kv for a masked pass)
            want = _passes(t)
    assert routed >= 3 * t.num_layers  # the verify, the tree and the padded batch took the copy-free route
    assert sum(gqa_calls) == routed  # … and none of the reference passes did
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_left_as_is_where_it_does_not_apply(tiny_target_dirs):
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_pretrained(tiny_target_dirs["llama"], attn_implementation="eager")
    assert not attention.route_attention(eager) and eager.config._attn_implementation == "eager"
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    vl = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_target_dirs["qwen3_5_vl"])  # with its vision tower
    assert not attention.route_attention(vl) and vl.config._attn_implementation != attention.NAME
    text = Target.load(tiny_target_dirs["qwen3_5_vl"])  # what dflashkit loads of it: the text model, routed
    assert text.model.config._attn_implementation == attention.NAME
