"""Whole decoder layers compiled for the CPU (target/native_layers.py, kernels/decoder_layer.cpp): a decoding pass
through them equals transformers' pass — logits, captured features and the cache's new keys and values — as
closely as transformers' own float32 pass equals a float64 one, for Llama (with and without biases), Qwen2 (q/k/v
biases) and Qwen3 (per-head q/k norms), one row to a tree's; decoding through them is lossless; the passes they
do not take run transformers' layers; layers of other kinds are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from dflashkit.cpu_products import native_rows, products
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.target.cache import crop
from dflashkit.target.kv_buffer import growing_cache
from dflashkit.target.model import Target
from dflashkit.target.native_layers import LayerPlan
from helpers.choices import set_choice
from helpers.oracles import PositionalOracle, drafter_config, reference_greedy

pytestmark = pytest.mark.skipif(not native_rows.enabled(), reason="no C++ compiler here")

CONTEXT = 23


def _model(kind: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "llama_biases":
        model = LlamaForCausalLM(LlamaConfig(**common, attention_bias=True, mlp_bias=True))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # margins as real targets have (transformers' init is tiny)
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.08) if p.dim() >= 2 else p.add_(
                0.1 * torch.randn_like(p)
            )
    return model.eval()


def _tree_mask(parents: list[int], held: int) -> torch.Tensor:
    """(1, 1, n, held + n) additive: each node sees the context, itself and its ancestors."""
    n = len(parents)
    mask = torch.zeros(1, 1, n, held + n)
    mask[..., held:] = float("-inf")
    for i in range(n):
        j = i
        while j >= 0:
            mask[0, 0, i, held + j] = 0.0
            j = parents[j]
    return mask


def _pass(target: Target, way: str, n: int, mask, monkeypatch, layer_ids=(0, 2)):
    """Prefill CONTEXT tokens, then one pass of n tokens under products=way: (logits, features, the
    new keys and values of layer 1)."""
    g = torch.Generator().manual_seed(7)
    ctx = torch.randint(3, 97, (1, CONTEXT), generator=g)
    new = torch.randint(3, 97, (1, n), generator=g)
    cache = target.new_cache()
    with products.stock_products():
        target.forward(ctx, cache=cache, use_cache=True, logits=False)
    depths = [0] * n
    if mask is not None:
        parents = _PARENTS[:n]
        for i, p in enumerate(parents):
            depths[i] = 0 if p < 0 else depths[p] + 1
        mask = mask.to(target.dtype)
    pos = (CONTEXT + torch.tensor(depths if mask is not None else list(range(n))))[None]
    set_choice(monkeypatch, "products", way)
    out = target.forward(new, cache=cache, use_cache=True, position_ids=pos, attention_mask=mask, layer_ids=layer_ids)
    layer = cache.layers[1]
    return out.logits, out.features, layer.keys[..., CONTEXT:, :].clone(), layer.values[..., CONTEXT:, :].clone()


_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 4]  # a tree of 9 nodes


@pytest.mark.parametrize("kind", ["llama", "llama_biases", "qwen2", "qwen3"])
@pytest.mark.parametrize("rows,tree", [(1, False), (4, False), (9, False), (9, True)])
def test_compiled_layers_equal_transformers(kind, rows, tree, monkeypatch):
    model = _model(kind)
    target = Target(model)
    assert target.native_layers is not None, LayerPlan.why_not(target.text_model)
    reference = Target(_model(kind).double())  # the same weights in float64: transformers' layers
    assert reference.native_layers is None
    mask = _tree_mask(_PARENTS[:rows], CONTEXT) if tree else None
    compiled = _pass(target, products.LAYERS, rows, mask, monkeypatch)
    stock = _pass(target, "stock", rows, mask, monkeypatch)
    exact = _pass(reference, "stock", rows, mask, monkeypatch)
    for name, c, s, e in zip(("logits", "features", "keys", "values"), compiled, stock, exact, strict=True):
        e = e.float()
        scale = float(e.abs().max())
        stock_err = float((s - e).abs().max())
        err = float((c - e).abs().max())
        # float32 rounding in another summation order: as close to float64 as transformers' own pass, give or take
        assert err <= 4 * stock_err + 1e-6 * scale, (name, err, stock_err)
        assert torch.equal(c.argmax(-1), e.argmax(-1)) if name == "logits" else True


def test_compiled_layers_run_only_when_chosen_and_taken(monkeypatch):
    target = Target(_model("llama"))
    calls = []
    run = LayerPlan.run
    monkeypatch.setattr(LayerPlan, "run", lambda self, *a: calls.append(a[0].shape) or run(self, *a))
    _pass(target, products.LAYERS, 4, None, monkeypatch)
    assert calls == [(1, 4)]
    _pass(target, products.NATIVE, 4, None, monkeypatch)  # another candidate: transformers' layers
    assert len(calls) == 1
    cache = target.new_cache()
    with products.stock_products():
        target.forward(torch.tensor([[5, 6, 7]]), cache=cache, use_cache=True)
    set_choice(monkeypatch, "products", products.LAYERS)
    target.forward(torch.tensor([[5, 6], [7, 8]]), cache=growing_cache(target.model.config), use_cache=True)
    assert len(calls) == 1  # a batch of two: not taken
    bool_mask = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    target.forward(torch.tensor([[5, 6]]), cache=cache, use_cache=True, attention_mask=bool_mask)
    assert len(calls) == 1  # a boolean mask: not taken
    crop(cache, 3)
    target.forward(torch.tensor([[5, 6]]), cache=cache, use_cache=True)
    assert len(calls) == 2
    target.forward(torch.tensor([[5, 6]]))  # no cache: a one-off pass
    assert len(calls) == 2


def test_the_cache_grows_and_compacts_under_compiled_passes(monkeypatch):
    """Many compiled steps past the buffers' room (regrowth copies), then a crop: each step's logits equal
    transformers' layers over the same cache."""
    target = Target(_model("qwen3"))
    prompt = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    caches = {}
    for way in (products.LAYERS, "stock"):
        set_choice(monkeypatch, "products", way)
        cache = caches[way] = target.new_cache()
        with products.stock_products():
            target.forward(prompt, cache=cache, use_cache=True)
    set_choice(monkeypatch, "products", "stock")
    for step in range(300):  # past MIN_ROOM: the buffers are reallocated at least once
        ids = torch.tensor([[3 + step % 90, 4 + step % 90]])
        outs = {}
        for way, cache in caches.items():
            set_choice(monkeypatch, "products", way)
            outs[way] = target.forward(ids, cache=cache, use_cache=True).logits
            crop(cache, cache.layers[0].get_seq_length() - 1)  # keep one of the two: a rejected draft
        assert torch.allclose(outs[products.LAYERS], outs["stock"], atol=1e-4, rtol=1e-4), step


@pytest.mark.parametrize("method", ["ar", "chain", "tree"])
def test_decoding_through_compiled_layers_is_lossless(tiny_llama_dir, monkeypatch, method):
    target = Target.load(tiny_llama_dir)
    set_choice(monkeypatch, "products", products.LAYERS)
    calls = []
    run = LayerPlan.run
    monkeypatch.setattr(LayerPlan, "run", lambda self, *a: calls.append(1) or run(self, *a))
    for seed in range(2):
        prompt = torch.randint(3, 97, (7 + seed,), generator=torch.Generator().manual_seed(seed))
        ref = reference_greedy(target, prompt, 40)  # transformers' generate
        drafter = PositionalOracle(drafter_config(), prompt.tolist() + ref, p_correct=0.8, seed=seed).eval()
        settings = DecodeSettings(method=method, max_new_tokens=40, tree_budget=10, tree_top_k=2, check_invariants=True)
        assert generate(target, prompt, drafter=drafter, settings=settings).tokens == ref, (method, seed)
    assert calls  # the passes did run compiled


def test_layers_of_other_kinds_are_refused_with_the_reason(tiny_target_dirs):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hybrid = Target.load(tiny_target_dirs["qwen3_5"])
    assert hybrid.native_layers is None
    assert "layer 0: Qwen3_5DecoderLayer is not one of" in LayerPlan.why_not(hybrid.text_model)
    cfg = Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0,
    )  # fmt: skip
    windowed = Qwen2ForCausalLM(cfg).eval()
    assert LayerPlan.why_not(windowed.model) == "layer 0: a sliding-window layer"
    half = _model("llama").to(torch.bfloat16)
    assert "float32" in LayerPlan.why_not(half.model)
    assert "whole_layers" not in repr(products.group_candidates(Target(half)._pass_group))
    assert products.LAYERS not in products.group_candidates(Target(half)._pass_group)
    assert products.LAYERS in products.group_candidates(Target(_model("llama"))._pass_group)


@pytest.mark.parametrize("layers_cost,expected", [(1.0, products.LAYERS), (500.0, "few_rows")])
def test_compiled_layers_are_chosen_by_timing_real_steps(monkeypatch, tmp_path, layers_cost, expected):
    """The compiled layers are one more candidate of the layers' pass group, timed in whole decoding steps against
    the products (injected clock: a product call costs its candidate's speed, a compiled pass `layers_cost`) and
    kept only where faster; Target.forward opens each pass once, whichever way it then runs."""
    from helpers.product_fakes import clocked_candidates, use_chooser

    target = Target(_model("llama"))
    group = target._pass_group
    now, seen = [0.0], []
    chooser = use_chooser(monkeypatch, products.Chooser(store=tmp_path / "c.json", repeats=3, clock=lambda: now[0]))
    run = LayerPlan.run

    def clocked_run(self, *a):
        now[0] += layers_cost
        return run(self, *a)

    monkeypatch.setattr(LayerPlan, "run", clocked_run)
    clocked_candidates(monkeypatch, {"stock": 20.0, "few_rows": 10.0}, now, seen)
    cache = target.new_cache()
    with products.stock_products():
        target.forward(torch.tensor([[5, 6, 7, 8]]), cache=cache, use_cache=True)
    key = group.key(1, torch.float32)
    opened = []
    real_open = products.open_pass
    monkeypatch.setattr("dflashkit.target.model.open_pass", lambda *a: opened.append(1) or real_open(*a))
    for step in range(200):
        if key in chooser.choices:
            break
        target.forward(torch.tensor([[9 + step % 50]]), cache=cache, use_cache=True, logits=False)  # the layers alone
        crop(cache, 4)
    entry = chooser.choices[key]
    assert entry["choice"] == expected and entry["timed"] == "steps"
    assert entry[f"{products.LAYERS}_ms"] == pytest.approx(1e3 * layers_cost)
    assert len(opened) == step  # one opening a pass, by Target.forward (the first linear did not open it again)
    assert not group.opened_outside  # closed after every pass


def test_a_width_first_timed_in_passes_of_the_layers_own_leaves_the_compiled_layers_out(monkeypatch, tmp_path):
    """Passes its caller does not open (transformers' `generate` calling the model: a regeneration batch) cannot
    run compiled: their width's trial leaves native_layers out and records it unusable (so a stored choice is
    complete, not timed again in every process)."""
    from helpers.product_fakes import clocked_candidates, use_chooser

    target = Target(_model("llama"))
    now, seen = [0.0], []
    chooser = use_chooser(monkeypatch, products.Chooser(store=tmp_path / "c.json", repeats=3, clock=lambda: now[0]))
    clocked_candidates(monkeypatch, {"stock": 20.0, "few_rows": 10.0}, now, seen)
    run = LayerPlan.run
    monkeypatch.setattr(LayerPlan, "run", lambda self, *a: pytest.fail("a compiled pass") or run(self, *a))
    prompt = torch.randint(3, 97, (2, 4), generator=torch.Generator().manual_seed(0))  # a batch of two
    key = target._pass_group.key(2, torch.float32)
    with torch.no_grad():
        for _ in range(10):
            if key in chooser.choices:
                break
            target.model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    entry = chooser.choices[key]
    assert entry["choice"] != products.LAYERS and entry[f"{products.LAYERS}_ms"] is None
