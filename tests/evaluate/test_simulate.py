"""Teacher-forced simulation: per-round acceptance lengths equal the real decode loop's at T = 0 (chain and DDTree,
oracle and random drafters), one transcript cache serves drafters with different layer sets, and damaged or
mismatched caches are refused with a clear DataError."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import DataError, TargetError
from dflashkit.evaluate.simulate import simulate, simulate_many
from dflashkit.evaluate.stats import Prompt
from dflashkit.evaluate.transcripts import TranscriptCache, build_transcripts
from dflashkit.target.model import Target
from helpers.oracles import PositionalOracle, drafter_config, make_prompts


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return Target.load(tiny_llama_dir)


def test_simulation_equals_real_loop(llama, tmp_path):
    prompts = make_prompts(2)
    n_new = 30
    cache = build_transcripts(
        llama, prompts, tmp_path / "tr", max_new_tokens=n_new, layer_ids=[1, 4, 6], progress=False
    )
    # the oracle knows the greedy continuation of prompt p0 (it proposes noise-level junk for p1)
    ref = prompts[0].ids + cache.load(0).ids[len(prompts[0].ids) :]
    torch.manual_seed(0)
    drafters = {
        "oracle": PositionalOracle(drafter_config(), ref, p_correct=0.75, seed=3).eval(),
        "random": DFlashDrafter(drafter_config()).eval(),
    }
    sims = simulate_many(drafters, cache, tree_budgets=[3, 10], tree_top_k=2, progress=False)
    for name, d in drafters.items():
        for method, kw in (("chain", {}), ("ddtree:3", {"tree_budget": 3}), ("ddtree:10", {"tree_budget": 10})):
            taus = []
            for p in prompts:
                res = generate(
                    llama,
                    p.ids,
                    drafter=d,
                    settings=DecodeSettings(
                        method="tree" if kw else "chain",
                        max_new_tokens=n_new,
                        tree_top_k=2,
                        check_invariants=True,
                        **kw,
                    ),
                )
                assert sims[name][method]["per_prompt"][p.id] == res.acceptance_lengths, (name, method, p.id)
                taus.append(res.tau)
            assert sims[name][method]["tau_macro"] == pytest.approx(sum(taus) / len(taus))
    chain, tree = sims["oracle"]["chain"], sims["oracle"]["ddtree:10"]
    assert chain["per_prompt"]["p0"] and max(chain["per_prompt"]["p0"]) > 2  # acceptance exercised
    assert sum(tree["per_prompt"]["p0"]) / len(tree["per_prompt"]["p0"]) > sum(chain["per_prompt"]["p0"]) / len(
        chain["per_prompt"]["p0"]
    )  # the tree recovers 2nd ranks
    assert sum(sims["random"]["chain"]["histogram"]) == sims["random"]["chain"]["rounds"]
    # the one-drafter form gives the same numbers
    single = simulate(drafters["oracle"], tmp_path / "tr", tree_budgets=[3], tree_top_k=2)
    assert single["chain"]["per_prompt"] == chain["per_prompt"]


def test_simulation_with_stop_token_and_short_block(llama, tmp_path):
    p = make_prompts(1, seed=4)[0]
    free = generate(llama, p.ids, settings=DecodeSettings(method="ar", max_new_tokens=20)).tokens
    stop = free[9]
    cache = build_transcripts(
        llama, [p], tmp_path / "tr", max_new_tokens=20, layer_ids=[1, 4, 6], stop_token_ids=[stop], progress=False
    )
    assert cache.load(0).stop_reason == "stop_token"
    ref = p.ids + free
    d = PositionalOracle(drafter_config(bs=4), ref, p_correct=0.5, seed=1).eval()
    sim = simulate(d, cache, block_size=3, tree_budgets=[2], tree_top_k=2)
    real = generate(
        llama,
        p.ids,
        drafter=d,
        settings=DecodeSettings(method="chain", block_size=3, max_new_tokens=20, stop_token_ids=[stop]),
    )
    # the last round may accept drafts past the stop token in the real loop only: compare all rounds before it
    assert sim["chain"]["per_prompt"][p.id][:-1] == real.acceptance_lengths[:-1]
    assert sim["chain"]["max_length"] == 3 and len(sim["chain"]["survival"]) == 3


def test_layers_are_stored_separately(llama, tmp_path):
    prompts = make_prompts(2, seed=1)
    cache = build_transcripts(
        llama, prompts, tmp_path / "tr", max_new_tokens=12, layer_ids=[7, 1, 4, 2, 6], progress=False
    )
    assert cache.layer_ids == [1, 2, 4, 6, 7]
    keys = set(load_file(str(tmp_path / "tr" / cache.entries[0]["file"])))
    assert keys == {"input_ids", "layer1", "layer2", "layer4", "layer6", "layer7"}
    torch.manual_seed(1)
    a, b = DFlashDrafter(drafter_config([1, 4])).eval(), DFlashDrafter(drafter_config([2, 6, 7])).eval()
    sims = simulate_many({"a": a, "b": b}, cache, tree_budgets=[4], progress=False)
    for name, d in (("a", a), ("b", b)):
        real = generate(llama, prompts[1].ids, drafter=d, settings=DecodeSettings(method="chain", max_new_tokens=12))
        assert sims[name]["chain"]["per_prompt"][prompts[1].id] == real.acceptance_lengths
    # features equal the target's own capture of those layers, in the drafter's order
    tr = cache.load(0)
    out = llama.forward(torch.tensor(tr.ids)[None], layer_ids=[6, 2], logits=False)
    torch.testing.assert_close(tr.features([6, 2]), out.features)
    with pytest.raises(TargetError, match=r"target layers \[3\] are not in the cache"):
        simulate(DFlashDrafter(drafter_config([1, 3])), cache, tree_budgets=[])


def test_cache_resume_and_damage(llama, tmp_path):
    prompts = make_prompts(3, seed=2)
    out = tmp_path / "tr"
    build_transcripts(llama, prompts[:2], out, max_new_tokens=8, layer_ids=[1, 4, 6], progress=False)
    first = (out / "p00000.safetensors").stat().st_mtime_ns
    cache = build_transcripts(llama, prompts, out, max_new_tokens=8, layer_ids=[4], progress=False)
    assert len(cache) == 3 and (out / "p00000.safetensors").stat().st_mtime_ns == first  # resumed, not redone
    with pytest.raises(DataError, match="max_new_tokens"):
        build_transcripts(llama, prompts, out, max_new_tokens=9, layer_ids=[1], progress=False)
    with pytest.raises(DataError, match=r"needs \[1, 3\]"):
        build_transcripts(llama, prompts, out, max_new_tokens=8, layer_ids=[1, 3], progress=False)
    with pytest.raises(DataError, match="different token ids"):
        build_transcripts(llama, [Prompt("p0", [3, 4, 5])], out, max_new_tokens=8, layer_ids=[1], progress=False)
    # a tensor with the wrong shape, then a truncated file, then a broken manifest
    t = load_file(str(out / "p00001.safetensors"))
    t["layer4"] = t["layer4"][:-1]
    save_file(t, str(out / "p00001.safetensors"))
    with pytest.raises(DataError, match=r"p00001.safetensors: tensor 'layer4'"):
        cache.load(1)
    (out / "p00002.safetensors").write_bytes(b"garbage")
    with pytest.raises(DataError, match="unreadable transcript"):
        cache.load(2)
    (out / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(DataError, match="not a dflashkit transcript manifest"):
        TranscriptCache(out)
    with pytest.raises(DataError, match=r"no manifest.json"):
        TranscriptCache(tmp_path / "nowhere")


def test_simulation_equals_real_loop_on_hybrid_target(tiny_hybrid_dir, tmp_path):
    """Hybrid (GatedDeltaNet) target: one-pass transcript features replay the chain loop's rounds exactly."""
    target = Target.load(tiny_hybrid_dir)
    p = make_prompts(1, seed=5)[0]
    cache = build_transcripts(target, [p], tmp_path / "tr", max_new_tokens=20, layer_ids=[1, 4, 6], progress=False)
    d = PositionalOracle(drafter_config(), cache.load(0).ids, p_correct=0.75, seed=1).eval()
    sim = simulate(d, cache, tree_budgets=[])
    real = generate(
        target, p.ids, drafter=d, settings=DecodeSettings(method="chain", max_new_tokens=20, check_invariants=True)
    )
    assert sim["chain"]["per_prompt"][p.id] == real.acceptance_lengths and real.tau > 1.5


class Recording(DFlashDrafter):
    """A random drafter network that records the length and hidden output of every block it reads."""

    def forward(self, *args, block_positions, **kw):
        out = super().forward(*args, block_positions=block_positions, **kw)
        self.__dict__.setdefault("calls", []).append((block_positions.shape[1], out.detach().clone()))
        return out


def test_simulation_drafts_full_last_blocks_like_the_real_loop(llama, tmp_path):
    """Odd max_new_tokens: the last round's block is still full in the replay and in the real loop (same drafter
    outputs), only what fits is verified, and the default DDTree top-k (= budget) is the same in both."""
    p = make_prompts(1, seed=6)[0]
    bs = 6
    for n_new in (7, 13):
        cache = build_transcripts(
            llama, [p], tmp_path / f"tr{n_new}", max_new_tokens=n_new, layer_ids=[1, 4, 6], progress=False
        )
        ids = cache.load(0).ids
        oracle = PositionalOracle(drafter_config(bs=bs), ids, p_correct=0.9, seed=2).eval()
        sim = simulate(oracle, cache, tree_budgets=[12])
        for method, kw in (("chain", {}), ("ddtree:12", {"tree_budget": 12})):
            real = generate(
                llama,
                p.ids,
                drafter=oracle,
                settings=DecodeSettings(
                    method="tree" if kw else "chain", max_new_tokens=n_new, check_invariants=True, **kw
                ),
            )
            assert sim[method]["per_prompt"][p.id] == real.acceptance_lengths, (n_new, method)
            assert sum(real.acceptance_lengths) + 1 >= n_new and len(real.tokens) == n_new
        torch.manual_seed(n_new)
        rec = Recording(drafter_config(bs=bs)).eval()
        simulate(rec, cache, tree_budgets=[])
        sim_calls, rec.calls = rec.calls, []
        generate(llama, p.ids, drafter=rec, settings=DecodeSettings(method="chain", max_new_tokens=n_new))
        assert [n for n, _ in sim_calls] == [n for n, _ in rec.calls] == [bs] * len(rec.calls)
        for (_, a), (_, b) in zip(sim_calls, rec.calls, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_last_round_counts_what_the_output_keeps_in_generate_and_simulate(kind, tiny_target_dirs, tmp_path):
    """With stop tokens inside the continuation and max_new_tokens cutting a block, every round's L — the last one
    included — is the same in the real loop and the replay, chain and DDTree, and ΣL + 1 = the tokens output: a
    draft accepted past a stop token or past max_new_tokens is not counted (it used to be, in the real loop)."""
    from dflashkit.evaluate.simulate import replay
    from dflashkit.evaluate.stats import parse_method
    from helpers.oracles import reference_greedy

    target = Target.load(tiny_target_dirs[kind])
    prompt = make_prompts(1, seed=1)[0]
    ref = reference_greedy(target, torch.tensor(prompt.ids), 40)
    checked = 0
    for stops in ([], [ref[5]], [ref[2], ref[9]]):
        for n in (2, 3, 5, 9, 13):
            cache = build_transcripts(
                target,
                [prompt],
                tmp_path / f"{kind}-{len(stops)}-{n}",
                max_new_tokens=n,
                layer_ids=[1, 4, 6],
                stop_token_ids=stops,
                progress=False,
            )
            for method in ("chain", "ddtree:4", "ddtree:8"):
                m = parse_method(method)
                make = lambda: PositionalOracle(drafter_config(), prompt.ids + ref, p_correct=0.9, seed=3).eval()  # noqa: E731
                real = generate(
                    target,
                    prompt.ids,
                    drafter=make(),
                    settings=DecodeSettings(
                        method=m.kind, max_new_tokens=n, tree_budget=m.budget or 16, stop_token_ids=stops
                    ),
                )
                sim = replay(
                    make(),
                    cache.load(0),
                    embed_weight=target.embed_weight,
                    lm_head_weight=target.lm_head_weight,
                    max_new_tokens=n,
                    method=m,
                )
                assert real.acceptance_lengths == sim, (stops, n, method)
                assert sum(real.acceptance_lengths) + 1 == len(real.tokens), (stops, n, method)
                checked += 1
    assert checked == 45


class _PositionalDSpark(DFlashDrafter):
    """A DSpark drafter whose backbone logits are a noisy oracle that depends only on the drafted position (so the
    real loop and the replay see the same proposals); its Markov head (random, non-zero) corrects them."""

    def __init__(self, cfg, reference, p_correct, seed=0):
        super().__init__(cfg)
        self.reference, self.p_correct, self.seed = reference, p_correct, seed

    def forward(self, *args, block_positions, **kw):
        self._positions = block_positions[0].tolist()
        return super().forward(*args, block_positions=block_positions, **kw)

    def logits(self, hidden, lm_head_weight):
        out = torch.empty(hidden.shape[0], lm_head_weight.shape[0])
        for k in range(hidden.shape[0]):
            pos = self._positions[k] + 1
            g = torch.Generator().manual_seed(self.seed * 1000 + pos)
            out[k] = torch.randn(out.shape[1], generator=g)
            true = self.reference[pos] if pos < len(self.reference) else 0
            if torch.rand(1, generator=g).item() < self.p_correct:
                out[k, true] = 30.0
        return out


def test_dspark_simulation_equals_real_loop(llama, tmp_path):
    prompts = make_prompts(2)
    n_new = 30
    cache = build_transcripts(
        llama, prompts, tmp_path / "tr", max_new_tokens=n_new, layer_ids=[1, 4, 6], progress=False
    )
    ref = prompts[0].ids + cache.load(0).ids[len(prompts[0].ids) :]
    cfg = drafter_config(bs=4).replace(kind="dspark", markov_rank=8)
    torch.manual_seed(0)
    drafters = {
        "oracle": _PositionalDSpark(cfg, ref, p_correct=0.8, seed=2).eval(),
        "random": DFlashDrafter(cfg).eval(),
    }
    with torch.no_grad():
        for d in drafters.values():
            d.markov_head.markov_w2.weight.normal_(0, 1.0)
    sims = simulate_many(drafters, cache, tree_budgets=[3], tree_top_k=2, progress=False)
    for name, d in drafters.items():
        for method, kw in (("chain", {}), ("ddtree:3", {"tree_budget": 3})):
            for p in prompts:
                res = generate(
                    llama,
                    p.ids,
                    drafter=d,
                    settings=DecodeSettings(
                        method="tree" if kw else "chain",
                        max_new_tokens=n_new,
                        tree_top_k=2,
                        check_invariants=True,
                        **kw,
                    ),
                )
                assert sims[name][method]["per_prompt"][p.id] == res.acceptance_lengths, (name, method, p.id)
    chain = sims["oracle"]["chain"]
    assert chain["max_length"] == 5 and max(chain["per_prompt"]["p0"]) > 2  # bs drafts + bonus, exercised
