"""DDTree on hybrid targets (tiny random Qwen3.5 layer mix, the Qwen3.5 VL wrapper, Qwen3-Next): exact tree
verification with the recurrent state of every node's own path.

- one "levels" pass gives every tree node the logits of the stock model run on that node's root path;
- after commit the cache equals a fresh prefill of the committed tokens (attention K/V, conv and recurrent states);
- greedy output equals the target's own greedy decoding for budgets 1…32, with drafters of very different
  quality (trained, noisy oracles); per-round acceptance lengths equal `simulate`'s DDTree replay on the same
  transcript, so the tree gain is real;
- taking recurrent states from a stale or wrong branch, or running the recurrent layers over the flattened tree
  as if it were a sequence, breaks greedy equality (the state handling is what makes it exact);
- a chain-shaped tree verifies exactly like chain verification.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.decode import hybrid_tree as ht
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.decode.tree import DraftTree, build_tree, tree_attention_bias
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.evaluate.simulate import simulate_many
from dflashkit.evaluate.stats import Prompt
from dflashkit.evaluate.transcripts import build_transcripts
from dflashkit.target.model import Target
from helpers.oracles import PositionalOracle, drafter_config, reference_greedy

BUDGETS = (1, 2, 4, 8, 16, 32)
N_NEW = 30


@pytest.fixture(scope="module")
def targets(tiny_target_dirs) -> dict[str, Target]:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    vl = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_target_dirs["qwen3_5_vl"])  # .model.language_model
    return {"qwen3_5": Target.load(tiny_target_dirs["qwen3_5"]), "qwen3_5_vl": Target(vl)}


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (6 + i,), generator=g) for i in range(n)]  # distinct lengths (oracle keys)


def train_drafter(target: Target, seqs: list[torch.Tensor], tmp_path) -> DFlashDrafter:
    """A drafter trained for 60 steps on the target's greedy continuations of `seqs`: good on those, poor
    elsewhere — the real-drafter end of the quality range."""
    from dflashkit.drafter.checkpoint import load_drafter
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train

    drafter_kw = dict(num_hidden_layers=1, block_size=6, mask_token_id=5)
    layer_ids = default_drafter_config(target, **drafter_kw).target_layer_ids
    samples = []
    for i, p in enumerate(seqs):
        ids = torch.cat(
            [p, torch.tensor(generate(target, p, settings=DecodeSettings(method="ar", max_new_tokens=N_NEW)).tokens)]
        )
        mask = torch.arange(len(ids)) >= len(p)
        out = target.forward(ids[None], layer_ids=layer_ids)
        samples.append(Sample(f"s{i}", ids, mask, out.features[0], out.logits[0].argmax(-1)))
    cfg = TrainConfig(
        out=str(tmp_path),
        drafter=drafter_kw,
        max_tokens=96,
        max_steps=60,
        save_every=0,
        progress=False,
        tensorboard=False,
        lr=3e-3,
        warmup_ratio=0.02,
    )
    train(cfg, dataset=samples, target=target)
    return load_drafter(tmp_path / "final").eval()


@pytest.fixture(scope="module")
def trained(targets, tmp_path_factory) -> dict[str, DFlashDrafter]:
    return {
        k: train_drafter(t, prompts(4, seed=1)[:2], tmp_path_factory.mktemp(f"drafter_{k}")) for k, t in targets.items()
    }


def oracle_tree(target: Target, prompt: torch.Tensor, budget: int, seed: int) -> tuple[DraftTree, list[int]]:
    """A DDTree whose marginals favour the target's true continuation (so paths of several nodes are accepted)."""
    ref = prompt.tolist() + reference_greedy(target, prompt, 8)
    d = PositionalOracle(drafter_config(), ref, p_correct=0.7, seed=seed)
    d._positions = list(range(len(prompt), len(prompt) + 6))
    logits = d.logits(torch.zeros(5, 1), target.lm_head_weight)  # (5, V)
    return build_tree(torch.log_softmax(logits, -1), ref[len(prompt)], budget=budget), ref


# ---------------------------------------------------------------------------------------------- one pass
def test_conv_windows_follow_each_nodes_path():
    parents = torch.tensor([-1, 0, 0, 1, 3, 3, 2, 5])
    depths = torch.tensor([0, 1, 1, 2, 3, 3, 2, 4])
    tree = DraftTree(tokens=torch.arange(8), parents=parents, depths=depths, log_probs=torch.zeros(8))
    sched = ht.TreeSchedule.of(tree, "cpu")
    kernel = 4
    before, after = sched.conv_windows(kernel)
    for i in range(8):
        path, j = [], i
        while j >= 0:
            path.append(kernel + j)
            j = int(parents[j])
        seq = list(range(kernel)) + path[::-1]  # committed columns 0…K−1, then the root path's node columns
        assert after[i].tolist() == seq[-kernel:] and before[i].tolist() == seq[-kernel - 1 : -1], i
    assert [lv.tolist() for lv in sched.levels] == [[0], [1, 2], [3, 6], [4, 5], [7]]
    assert sched.parent_rows[2].tolist() == [0, 1] and sched.parent_rows[4].tolist() == [1]
    # "scan": root-to-leaf paths padded with N = 8; every node's first occurrence
    assert sched.paths.tolist() == [[0, 1, 3, 4, 8], [0, 2, 6, 8, 8], [0, 1, 3, 5, 7]]  # leaves in tree order
    flat = sched.paths.flatten()
    assert all(int(flat[sched.hits[i]]) == i and int(sched.hits[i]) % 5 == int(depths[i]) for i in range(8))


@pytest.mark.parametrize("kind,scan", [("qwen3_5", True), ("qwen3_5", False), ("qwen3_5_vl", True)])
def test_one_pass_gives_every_node_its_own_path_logits(targets, kind, scan):
    target = targets[kind]
    prompt = prompts(1, seed=3)[0]
    for budget in (1, 9, 32):
        cache = target.new_cache()
        target.forward(prompt[None], cache=cache, use_cache=True, logits=False)
        tree, _ = oracle_tree(target, prompt, budget, seed=budget)
        start = len(prompt)
        tp = ht._TreePass(ht.TreeSchedule.of(tree, "cpu"), scan=scan, keep_states=True)
        with ht._tree_mixers(target, tp):
            out = target.forward(
                tree.tokens[None],
                cache=cache,
                use_cache=True,
                position_ids=(start + tree.depths)[None],
                attention_mask=tree_attention_bias(tree.parents, start, dtype=target.dtype, device="cpu"),
            )
        assert int(tree.depths.max()) >= min(budget, 3)
        for i, path in enumerate(_node_paths(tree)):
            ref = target.forward(torch.cat([prompt, tree.tokens[path]])[None]).logits[0, -1]  # fresh, stock model
            torch.testing.assert_close(out.logits[0, i], ref, atol=1e-4, rtol=1e-4)
        # the committed states were only read: the cache still holds the prompt's
        fresh = target.new_cache()
        target.forward(prompt[None], cache=fresh, use_cache=True, logits=False)
        _assert_states_close(cache, fresh)


def _node_paths(tree: DraftTree) -> list[list[int]]:
    parents = tree.parents.tolist()
    out = []
    for i in range(tree.size):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


def _assert_states_close(cache, ref, *, kv: bool = False) -> None:
    for layer, want in zip(cache.layers, ref.layers, strict=True):
        if hasattr(want, "recurrent_states"):
            torch.testing.assert_close(layer.conv_states[0], want.conv_states[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer.recurrent_states[0], want.recurrent_states[0], atol=1e-5, rtol=1e-4)
        elif kv:
            torch.testing.assert_close(layer.keys, want.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer.values, want.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode,keep", [("scan", False), ("levels", True), ("levels", False), ("paths", True)])
def test_commit_equals_fresh_prefill_of_the_committed_tokens(targets, mode, keep, monkeypatch):
    """After verify_tree the cache is exactly that of feeding prompt + accepted path: K/V, conv window and recurrent
    state (kept node states, or the accepted path replayed), and the next logits agree."""
    if not keep:
        monkeypatch.setattr(ht, "KEEP_STATES_MAX_BYTES", 0)
    target = targets["qwen3_5"]
    accepted = []
    for seed, prompt in enumerate(prompts(3, seed=4)):
        cache = target.new_cache()
        target.forward(prompt[None], cache=cache, use_cache=True, logits=False)
        tree, ref = oracle_tree(target, prompt, 16, seed=seed)
        verdict = ht.verify_tree(target, cache, tree, len(prompt), layer_ids=[1, 4], mode=mode)
        committed = tree.tokens[verdict.path]
        assert committed.tolist() == ref[len(prompt) : len(prompt) + len(verdict.path)]  # the greedy path
        assert verdict.next_token == ref[len(prompt) + len(verdict.path)]
        full = torch.cat([prompt, committed])[None]
        fresh = target.new_cache()
        out = target.forward(full, layer_ids=[1, 4], cache=fresh, use_cache=True)
        _assert_states_close(cache, fresh, kv=True)
        torch.testing.assert_close(verdict.features, out.features[:, len(prompt) :], atol=1e-4, rtol=1e-4)
        nxt = torch.tensor([[verdict.next_token]])
        pos = torch.tensor([[full.shape[1]]])
        a = target.forward(nxt, cache=cache, use_cache=True, position_ids=pos).logits[0, -1]
        b = target.forward(nxt, cache=fresh, use_cache=True, position_ids=pos).logits[0, -1]
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        accepted.append(len(verdict.path))
    assert max(accepted) >= 3  # deep accepted paths were exercised


# ---------------------------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_vl"])
def test_greedy_tree_is_lossless_for_every_budget_and_drafter(targets, trained, kind):
    target = targets[kind]
    taus: dict[tuple[str, object], list[float]] = {}
    for i, prompt in enumerate(prompts(4, seed=1)[1:]):  # prompt 1 was trained on, prompts 2 and 3 were not
        ref = reference_greedy(target, prompt, N_NEW)
        full = prompt.tolist() + ref
        drafters = {
            "trained": lambda: trained[kind],
            "oracle_0.9": lambda full=full, i=i: PositionalOracle(drafter_config(), full, p_correct=0.9, seed=i).eval(),
            "oracle_0.4": lambda full=full, i=i: PositionalOracle(drafter_config(), full, p_correct=0.4, seed=i).eval(),
        }
        for name, make in drafters.items():
            chain = generate(
                target, prompt, drafter=make(), settings=DecodeSettings(method="chain", max_new_tokens=N_NEW)
            )
            assert chain.tokens == ref, (kind, name, "chain")
            taus.setdefault((name, "chain"), []).append(chain.tau)
            for budget in BUDGETS:
                res = generate(
                    target,
                    prompt,
                    drafter=make(),
                    settings=DecodeSettings(
                        method="tree", tree_budget=budget, max_new_tokens=N_NEW, check_invariants=True
                    ),
                )
                assert res.tokens == ref, (kind, name, budget, i)
                taus.setdefault((name, budget), []).append(res.tau)
    mean = {k: sum(v) / len(v) for k, v in taus.items()}
    for name in ("oracle_0.9", "oracle_0.4"):  # the tree gain is real: DDTree-32 beats the chain
        assert mean[(name, 32)] > mean[(name, "chain")] + 0.3, (name, mean)
    assert mean[("oracle_0.9", 32)] > mean[("oracle_0.4", 32)] + 1.0  # very different drafter quality
    assert max(taus[("trained", 16)]) > 2.0 > min(taus[("trained", 16)])


def test_every_mode_is_lossless_and_they_agree(targets):
    target = targets["qwen3_5"]
    for i, prompt in enumerate(prompts(2, seed=7)):
        ref = reference_greedy(target, prompt, N_NEW)
        full = prompt.tolist() + ref
        for budget in (3, 32):
            runs = {
                mode: generate(
                    target,
                    prompt,
                    drafter=PositionalOracle(drafter_config(), full, 0.6, seed=i).eval(),
                    settings=DecodeSettings(
                        method="tree", tree_budget=budget, max_new_tokens=N_NEW, hybrid_tree=mode, check_invariants=True
                    ),
                )
                for mode in ("scan", "levels", "paths")
            }
            assert runs["scan"].tokens == runs["levels"].tokens == runs["paths"].tokens == ref
            lengths = {mode: r.acceptance_lengths for mode, r in runs.items()}
            assert lengths["scan"] == lengths["levels"] == lengths["paths"], lengths


def test_acceptance_lengths_equal_simulated_ddtree(targets, trained, tmp_path):
    """The real loop's per-round L equals simulate's DDTree replay of the same greedy transcript, per budget and
    drafter: the acceptance a tree-capable verifier should get is what hybrid tree verification gets."""
    target = targets["qwen3_5"]
    ps = [Prompt(f"p{i}", p.tolist()) for i, p in enumerate(prompts(3, seed=1))]
    cache = build_transcripts(
        target, ps, tmp_path / "tr", max_new_tokens=N_NEW, layer_ids=[1, 2, 3, 4, 5, 6], progress=False
    )
    refs = {len(p.ids): cache.load(i).ids for i, p in enumerate(ps)}
    drafters = {
        "oracle": PositionalOracle(drafter_config(), refs, p_correct=0.6, seed=5).eval(),
        "trained": trained["qwen3_5"],
    }
    budgets = [1, 4, 16, 32]
    sims = simulate_many(drafters, cache, tree_budgets=budgets, progress=False)
    for name, d in drafters.items():
        for budget in budgets:
            for p in ps:
                real = generate(
                    target,
                    p.ids,
                    drafter=d,
                    settings=DecodeSettings(method="tree", tree_budget=budget, max_new_tokens=N_NEW),
                )
                assert real.acceptance_lengths == sims[name][f"ddtree:{budget}"]["per_prompt"][p.id], (name, budget)
    oracle = sims["oracle"]
    assert oracle["ddtree:32"]["tau_macro"] > oracle["chain"]["tau_macro"] + 0.3


def test_chain_shaped_tree_equals_chain_on_hybrid(targets):
    target = targets["qwen3_5"]
    prompt = prompts(1, seed=9)[0]
    full = prompt.tolist() + reference_greedy(target, prompt, N_NEW)
    runs = {}
    for method, mode in (("chain", "auto"), ("tree", "scan"), ("tree", "levels"), ("tree", "paths")):
        d = PositionalOracle(drafter_config(), full, p_correct=0.7, seed=2).eval()
        # top_k = 1 and budget = bs − 1: the tree is exactly the drafted chain
        runs[mode] = generate(
            target,
            prompt,
            drafter=d,
            settings=DecodeSettings(
                method=method,
                tree_top_k=1,
                tree_budget=5,
                max_new_tokens=N_NEW,
                hybrid_tree=mode,
                check_invariants=True,
            ),
        )
    for mode in ("scan", "levels", "paths"):
        assert runs[mode].tokens == runs["auto"].tokens
        assert runs[mode].acceptance_lengths == runs["auto"].acceptance_lengths
    assert max(runs["auto"].acceptance_lengths) > 2


# ---------------------------------------------------------------------------------------------- negative controls
def _stale(cache, records, schedule, path):  # the recurrent states keep the previous round's tokens only
    return None


def _wrong_branch(cache, records, schedule, path):  # the state of another node of the accepted depth, if any
    depth = int(schedule.depths[path[-1]])
    others = [int(n) for n in schedule.levels[depth] if int(n) != path[-1]]
    real_select(cache, records, schedule, path[:-1] + others[:1] if others else path)


real_select = ht.select_states


@pytest.mark.parametrize("mode", ["scan", "levels"])
@pytest.mark.parametrize("broken", ["stale_states", "wrong_branch", "flat_recurrence"])
def test_turning_state_handling_off_breaks_greedy_equality(targets, broken, mode, monkeypatch):
    target = targets["qwen3_5"]
    if broken == "flat_recurrence":  # the recurrent layers read the flattened tree as one sequence
        monkeypatch.setattr(ht, "_tree_mixers", lambda *a, **k: nullcontext())
    else:
        monkeypatch.setattr(ht, "select_states", _stale if broken == "stale_states" else _wrong_branch)
    equal = []
    for i, prompt in enumerate(prompts(2, seed=11)):
        ref = reference_greedy(target, prompt, N_NEW)
        d = PositionalOracle(drafter_config(), prompt.tolist() + ref, p_correct=0.6, seed=i).eval()
        equal.append(
            generate(
                target,
                prompt,
                drafter=d,
                settings=DecodeSettings(method="tree", tree_budget=16, max_new_tokens=N_NEW, hybrid_tree=mode),
            ).tokens
            == ref
        )
    assert not any(equal), broken


# ---------------------------------------------------------------------------------------------- other hybrids
def test_other_recurrent_layers_use_path_batching():
    """Qwen3-Next fuses its Gated DeltaNet projections (in_proj_qkvz): "auto" picks path batching, which runs the
    stock modules unchanged and is lossless; asking for "levels" is a clear error."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    cfg = Qwen3NextConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        layer_types=kinds * 2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        tie_word_embeddings=False,
    )
    model = Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.08)
    target = Target(model)
    assert target.is_hybrid and not ht.supports_one_pass(target) and ht.resolve_mode(target, "auto") == "paths"
    for mode in ("scan", "levels"):
        with pytest.raises(ht.HybridTreeError, match="use mode 'paths'"):
            ht.resolve_mode(target, mode)
    prompt = prompts(1, seed=13)[0]
    ref = reference_greedy(target, prompt, N_NEW)
    for budget in (2, 32):
        d = PositionalOracle(drafter_config(), prompt.tolist() + ref, p_correct=0.6, seed=1).eval()
        res = generate(
            target,
            prompt,
            drafter=d,
            settings=DecodeSettings(method="tree", tree_budget=budget, max_new_tokens=N_NEW, check_invariants=True),
        )
        assert res.tokens == ref and (budget == 2 or res.tau > 2)


def test_bad_hybrid_tree_mode(targets):
    with pytest.raises(ValueError, match="valid modes"):
        generate(
            targets["qwen3_5"],
            [3, 4, 5],
            drafter=DFlashDrafter(drafter_config()),
            settings=DecodeSettings(method="tree", hybrid_tree="beam"),
        )


def test_eval_report_says_hybrid_ddtree_verifies_the_whole_tree(targets, tmp_path):
    from dflashkit.evaluate.evaluate import EvalSettings, evaluate

    target = targets["qwen3_5"]
    ps = [Prompt(f"p{i}", p.tolist()) for i, p in enumerate(prompts(2, seed=15))]
    refs = {
        len(p.ids): p.ids + generate(target, p.ids, settings=DecodeSettings(method="ar", max_new_tokens=16)).tokens
        for p in ps
    }
    d = PositionalOracle(drafter_config(), refs, p_correct=0.6, seed=3).eval()
    doc = evaluate(
        target,
        {"oracle": d},
        ps,
        out_dir=tmp_path,
        settings=EvalSettings(
            methods="ar,chain,ddtree:16", max_new_tokens=16, progress=False, stop_token_ids=(), warmup=False
        ),
    )
    assert not any("spine" in n or "chain only" in n for n in doc["notes"])
    assert any("verifies the whole tree exactly" in n and "'scan'" in n for n in doc["notes"])
    res = doc["results"]["oracle"]
    assert res["ddtree:16"]["greedy_equal_fraction"] == 1.0
    assert res["ddtree:16"]["tau_micro"] > res["chain"]["tau_micro"]


@pytest.mark.parametrize("mode", ["scan", "levels", "paths"])
def test_tree_sampling_on_a_hybrid_target_matches_its_distribution(mode):
    """DDTree at T = 1 on a hybrid target, each mode: one sample per node from the logits of that node's own
    recurrent state reproduces the target's exact joint law of three tokens; the nodes' argmax does not."""
    from dflashkit.drafter.config import DrafterConfig
    from dflashkit.sampling import SamplingParams
    from helpers.joint_law import VOCAB, check_tree_joint_law, exact_joint, tiny_target

    target = tiny_target(hybrid=True)
    assert target.is_hybrid
    torch.manual_seed(1)
    cfg = DrafterConfig(
        hidden_size=32, vocab_size=VOCAB, num_target_layers=2, target_layer_ids=[0, 1], num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=4,
        mask_token_id=VOCAB - 1,
    )  # fmt: skip
    exact = exact_joint(target, SamplingParams(temperature=1.0))
    check_tree_joint_law(target, DFlashDrafter(cfg).eval(), exact, budget=4, hybrid_tree=mode)
