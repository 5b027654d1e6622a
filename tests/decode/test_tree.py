"""Tests of dflashkit.decode.tree: DDTree construction, tree attention masks, position ids and tree acceptance."""

from __future__ import annotations

import itertools
import random
from itertools import pairwise

import pytest
import torch

from dflashkit.decode.tree import (
    DraftTree,
    build_tree,
    chain_tree,
    follow_tree,
    resolve_top_k,
    tree_attention_bias,
    tree_attention_mask,
    tree_position_ids,
)
from helpers.bench_scripts import load_bench


def random_log_probs(gen: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    """(D, V) float64 log-softmax with distinct values (ties have probability ~0)."""
    return torch.log_softmax(torch.randn(depth, vocab, generator=gen, dtype=torch.float64) * 2.0, dim=-1)


def brute_force_top_prefixes(draft_log_probs: torch.Tensor, budget: int, top_k: int) -> list[tuple[int, ...]]:
    """Enumerate every prefix over the top-K tokens per depth; keep the `budget` most probable."""
    depth, vocab = draft_log_probs.shape
    k = min(top_k, vocab)
    values, indices = torch.topk(draft_log_probs, k, dim=-1)
    vals, toks = values.double().tolist(), indices.tolist()
    scored = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            lp = 0.0
            for i, r in enumerate(ranks):
                lp = lp + vals[i][r]
            scored.append((lp, tuple(toks[i][r] for i, r in enumerate(ranks))))
    scored.sort(key=lambda x: -x[0])
    return [p for _, p in scored[:budget]]


def prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """The token prefix (root excluded) of every non-root node."""
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(1, tree.size):
        seq, j = [], i
        while j > 0:
            seq.append(toks[j])
            j = parents[j]
        out.append(tuple(reversed(seq)))
    return out


def check_structure(tree: DraftTree, lp: torch.Tensor, budget: int, top_k: int, root: int) -> None:
    depth, vocab = lp.shape
    k = min(top_k, vocab)
    total = sum(k**d for d in range(1, depth + 1))
    assert tree.size == 1 + min(budget, total)
    toks, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    ranks, cum = tree.ranks.tolist(), tree.log_probs.tolist()
    assert toks[0] == root and parents[0] == -1 and depths[0] == 0 and cum[0] == 0.0 and ranks[0] == -1
    top_idx = torch.topk(lp, k, dim=-1).indices.tolist()
    for i in range(1, tree.size):
        p = parents[i]
        assert 0 <= p < i
        assert depths[i] == depths[p] + 1 <= depth
        assert 0 <= ranks[i] < k
        assert toks[i] == top_idx[depths[i] - 1][ranks[i]]
        assert cum[i] == pytest.approx(cum[p] + lp[depths[i] - 1, toks[i]].item(), abs=1e-5)
    pre = prefixes(tree)
    assert len(set(pre)) == len(pre)
    for t in (tree.tokens, tree.parents, tree.depths, tree.ranks):
        assert t.dtype == torch.long and t.shape == (tree.size,)


def test_build_tree_matches_brute_force_top_prefixes() -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(300):
        depth, vocab = rng.randint(1, 4), rng.randint(2, 6)
        top_k, budget = rng.randint(1, 4), rng.randint(0, 20)
        lp = random_log_probs(gen, depth, vocab)
        tree = build_tree(lp, 7, budget=budget, top_k=top_k)
        check_structure(tree, lp, budget, top_k, 7)
        assert set(prefixes(tree)) == set(brute_force_top_prefixes(lp, budget, top_k))


def test_force_spine_includes_top1_chain_and_fills_best_first() -> None:
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    for _ in range(200):
        depth, vocab = rng.randint(1, 4), rng.randint(2, 6)
        top_k, budget = rng.randint(1, 4), rng.randint(0, 20)
        lp = random_log_probs(gen, depth, vocab)
        tree = build_tree(lp, 3, budget=budget, top_k=top_k, force_spine=True)
        check_structure(tree, lp, budget, top_k, 3)
        top1 = lp.argmax(dim=-1).tolist()
        spine = [tuple(top1[: d + 1]) for d in range(min(budget, depth))]
        pre = prefixes(tree)
        assert pre[: len(spine)] == spine  # the spine comes first, in depth order
        rest = [p for p in brute_force_top_prefixes(lp, 10**9, top_k) if p not in set(spine)]
        assert set(pre[len(spine) :]) == set(rest[: budget - len(spine)])


def test_force_spine_can_differ_from_plain() -> None:
    # Depth 1 is near-uniform, depth 2 is peaked: the plain tree spends its budget at depth 1.
    lp = torch.log_softmax(torch.tensor([[1.0, 0.99, 0.98, 0.97], [5.0, 0.0, 0.0, 0.0]]), dim=-1)
    plain = build_tree(lp, 0, budget=3, top_k=4)
    spine = build_tree(lp, 0, budget=3, top_k=4, force_spine=True)
    assert plain.depths.tolist() == [0, 1, 1, 1]
    assert spine.depths.tolist() == [0, 1, 2, 1]
    assert prefixes(spine)[:2] == [(0,), (0, 0)]


def test_build_tree_edge_cases() -> None:
    lp = torch.log_softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(2)), dim=-1)
    assert build_tree(lp, 9, budget=0, top_k=3).size == 1
    assert build_tree(lp[:0], 9, budget=10, top_k=3).size == 1
    everything = build_tree(lp, 9, budget=10_000, top_k=2)
    assert everything.size == 1 + 2 + 4 + 8
    clamped = build_tree(lp, 9, budget=10_000, top_k=50)  # K > V is clamped to V
    assert clamped.size == 1 + 5 + 25 + 125
    chain = build_tree(lp, 9, budget=10, top_k=1)
    assert chain.depths.tolist() == [0, 1, 2, 3]
    assert chain.tokens[1:].tolist() == lp.argmax(-1).tolist()
    with pytest.raises(ValueError):
        build_tree(lp, 9, budget=-1, top_k=2)
    with pytest.raises(ValueError):
        build_tree(lp, 9, budget=3, top_k=-1)
    zero, none = build_tree(lp, 9, budget=7, top_k=0), build_tree(lp, 9, budget=7)  # 0 and None mean = budget
    assert torch.equal(zero.tokens, none.tokens) and torch.equal(zero.parents, none.parents)
    with pytest.raises(ValueError):
        build_tree(lp[0], 9, budget=3, top_k=2)


def all_prefixes_top(draft_log_probs: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """Reference without any top-K: every prefix over the whole vocabulary, scored by Π q_i(u_i); the best B."""
    depth, vocab = draft_log_probs.shape
    lp = draft_log_probs.double().tolist()
    scored = [
        (sum(lp[i][t] for i, t in enumerate(seq)), seq)
        for d in range(1, depth + 1)
        for seq in itertools.product(range(vocab), repeat=d)
    ]
    scored.sort(key=lambda x: -x[0])
    return {seq for _, seq in scored[:budget]}


def test_default_top_k_is_the_budget_and_gives_the_most_probable_prefixes() -> None:
    """DDTree reference: K = min(B, V), so the tree is exactly the B most probable prefixes of all V^d — also for
    budgets above 8 (the old default cap), where a K = 8 cap loses probability mass."""
    assert resolve_top_k(None, 12) == 12 and resolve_top_k(0, 12) == 12 and resolve_top_k(3, 12) == 3
    assert resolve_top_k(None, 0) == 1
    gen = torch.Generator().manual_seed(7)
    for trial in range(6):
        vocab, depth = (12, 3) if trial % 2 else (6, 4)
        scale = 0.3 if trial < 2 else 2.0  # flat marginals: many depth-1 tokens beat every deeper prefix
        lp = torch.log_softmax(torch.randn(depth, vocab, generator=gen, dtype=torch.float64) * scale, dim=-1)
        for budget in (9, 12, 17, 30, 64):
            tree = build_tree(lp, 0, budget=budget)
            check_structure(tree, lp, budget, min(budget, vocab), 0)
            assert set(prefixes(tree)) == all_prefixes_top(lp, budget), (trial, budget)
    # flat marginals, B = 12 > 8: the reference tree holds all 12 first tokens; a K = 8 cap holds less probability
    lp = torch.log_softmax(torch.randn(3, 12, generator=gen, dtype=torch.float64) * 0.1, dim=-1)
    full, capped = build_tree(lp, 0, budget=12), build_tree(lp, 0, budget=12, top_k=8)
    assert sorted(full.tokens[1:].tolist()) == list(range(12)) and full.depths[1:].tolist() == [1] * 12
    assert capped.log_probs[1:].exp().sum() < full.log_probs[1:].exp().sum()


def test_explicit_smaller_top_k_caps_the_branching() -> None:
    gen = torch.Generator().manual_seed(8)
    lp = random_log_probs(gen, 4, 9)
    for budget in (10, 25, 60):
        for top_k in (2, 3):
            tree = build_tree(lp, 5, budget=budget, top_k=top_k)
            check_structure(tree, lp, budget, top_k, 5)
            assert set(prefixes(tree)) == set(brute_force_top_prefixes(lp, budget, top_k))
            per_depth = {d: len({p[-1] for p in prefixes(tree) if len(p) == d}) for d in range(1, 5)}
            assert max(per_depth.values()) <= top_k


def test_build_tree_ties_are_deterministic() -> None:
    lp = torch.full((3, 4), -torch.log(torch.tensor(4.0)).item())
    a = build_tree(lp, 0, budget=12, top_k=4)
    b = build_tree(lp, 0, budget=12, top_k=4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


def test_build_tree_large_budget_is_consistent() -> None:
    lp = torch.log_softmax(torch.randn(15, 1000, generator=torch.Generator().manual_seed(3)), dim=-1)
    tree = build_tree(lp, 1, budget=512, top_k=32)
    assert tree.size == 513
    mask = tree_attention_mask(tree.parents)
    assert mask.sum(dim=-1).tolist() == (tree.depths + 1).tolist()


def naive_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_tree_attention_mask_matches_naive_ancestors() -> None:
    gen = torch.Generator().manual_seed(4)
    rng = random.Random(4)
    for _ in range(50):
        depth, vocab = rng.randint(1, 5), rng.randint(2, 6)
        lp = random_log_probs(gen, depth, vocab)
        tree = build_tree(lp, 0, budget=rng.randint(0, 30), top_k=rng.randint(1, 4), force_spine=rng.random() < 0.5)
        assert torch.equal(tree_attention_mask(tree.parents), naive_mask(tree.parents.tolist()))
    assert torch.equal(tree_attention_mask(torch.tensor([-1])), torch.ones(1, 1, dtype=torch.bool))


def test_tree_attention_bias_sees_the_cache_and_ancestors_only() -> None:
    parents = torch.tensor([-1, 0, 0, 1])
    bias = tree_attention_bias(parents, 3, dtype=torch.float32, device="cpu")
    assert bias.shape == (1, 1, 4, 7)
    allowed = bias[0, 0] == 0
    assert allowed[:, :3].all()  # every cached token
    assert torch.equal(allowed[:, 3:], naive_mask(parents.tolist()))  # itself and its ancestors
    assert (bias[0, 0][~allowed] == torch.finfo(torch.float32).min).all()


def test_tree_position_ids() -> None:
    depths = torch.tensor([0, 1, 1, 2, 3])
    assert tree_position_ids(depths, 10).tolist() == [10, 11, 11, 12, 13]


def hand_tree() -> DraftTree:
    #        0 (root=5)
    #      /    \
    #   1(7)    2(8)
    #   /  \      \
    # 3(9) 4(10)  5(7)
    #  |
    # 6(11)
    return DraftTree(
        tokens=torch.tensor([5, 7, 8, 9, 10, 7, 11]),
        parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]),
        depths=torch.tensor([0, 1, 1, 2, 2, 2, 3]),
        log_probs=torch.zeros(7),
    )


def test_follow_tree_hand_built() -> None:
    tree = hand_tree()
    assert tree.children(0) == [1, 2] and tree.children(1) == [3, 4] and tree.children(6) == []
    #                            node:  0  1   2   3   4   5   6
    assert follow_tree(tree, torch.tensor([7, 9, 0, 11, 0, 0, 42])) == [0, 1, 3, 6]
    assert follow_tree(tree, torch.tensor([7, 10, 0, 0, 0, 0, 0])) == [0, 1, 4]
    assert follow_tree(tree, torch.tensor([8, 0, 7, 0, 0, 0, 0])) == [0, 2, 5]
    assert follow_tree(tree, torch.tensor([8, 0, 9, 0, 0, 0, 0])) == [0, 2]
    assert follow_tree(tree, torch.tensor([3, 9, 7, 11, 0, 0, 0])) == [0]
    with pytest.raises(ValueError):
        follow_tree(tree, torch.tensor([7, 9]))


def naive_chain_accept(draft: list[int], target: list[int]) -> int:
    """Chain verification: target[k] is the target's token after root + draft[:k]."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return accepted


def test_follow_tree_on_chain_equals_chain_acceptance() -> None:
    rng = random.Random(5)
    for _ in range(300):
        depth = rng.randint(0, 8)
        draft = [rng.randint(0, 2) for _ in range(depth)]
        target = [rng.randint(0, 2) for _ in range(depth + 1)]
        tree = chain_tree(4, torch.tensor(draft, dtype=torch.long))
        assert tree.size == depth + 1
        assert tree.parents.tolist() == list(range(-1, depth))
        path = follow_tree(tree, torch.tensor(target))
        assert path == list(range(naive_chain_accept(draft, target) + 1))
        assert torch.equal(tree_attention_mask(tree.parents), torch.ones(depth + 1, depth + 1).tril().bool())


def test_follow_tree_path_length_bounds() -> None:
    gen = torch.Generator().manual_seed(6)
    rng = random.Random(6)
    for _ in range(200):
        depth, vocab = rng.randint(1, 5), rng.randint(2, 5)
        budget = rng.randint(0, 25)
        lp = random_log_probs(gen, depth, vocab)
        tree = build_tree(lp, 0, budget=budget, top_k=rng.randint(1, 4), force_spine=rng.random() < 0.5)
        target = torch.randint(0, vocab, (tree.size,), generator=gen)
        path = follow_tree(tree, target)
        assert 1 <= len(path) <= 1 + min(budget, depth)
        assert path[0] == 0
        parents, toks = tree.parents.tolist(), tree.tokens.tolist()
        for a, b in pairwise(path):
            assert parents[b] == a and toks[b] == target[a].item()
        last = path[-1]
        assert all(toks[c] != target[last].item() for c in tree.children(last))


def test_every_tree_top_k_default_is_the_budget() -> None:
    """generate, simulate, evaluate, bench/speed.py and the CLI all default to K = budget (None), not a cap."""
    import inspect

    from dflashkit.cli import build_parser
    from dflashkit.decode import generate as decode
    from dflashkit.evaluate import evaluate, simulate

    speed = load_bench("speed")
    for fn in (
        simulate.replay_rounds,
        simulate.simulate_many,
        simulate.simulate,
        simulate.simulation_results,
        speed.run_bench,
    ):
        assert inspect.signature(fn).parameters["tree_top_k"].default is None, fn.__qualname__
    assert decode.DecodeSettings().tree_top_k is None and evaluate.EvalSettings().tree_top_k is None
    parser = build_parser()
    base = {
        "generate": ["--prompt", "x"],
        "eval": ["--dataset", "d", "--out", "o"],
        "simulate": ["--dataset", "d", "--cache", "c", "--out", "o"],
    }
    for cmd, rest in base.items():
        assert parser.parse_args([cmd, *rest]).tree_top_k is None, cmd
        assert parser.parse_args([cmd, *rest, "--tree-top-k", "4"]).tree_top_k == 4
        assert parser.parse_args([cmd, *rest, "--tree-top-k", "0"]).tree_top_k is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--tree-top-k", "-2"])


def test_conditional_tree_is_the_top_prefixes_of_an_autoregressive_draft() -> None:
    """With per-parent distributions (DSpark's Markov head), the tree holds exactly the B most probable prefixes
    of the autoregressive draft (brute force over every prefix), prefix-closed; with parent-independent
    conditionals it equals the marginal tree."""
    import itertools

    g = torch.Generator().manual_seed(0)
    depth, vocab, budget = 3, 4, 9
    base = torch.randn(depth, vocab, generator=g) * 2
    bias = torch.randn(vocab + 1, vocab, generator=g) * 2  # row `vocab`: the root's token

    def conditional(d: int, parent: int, token: int, _up: int) -> torch.Tensor:
        return torch.log_softmax(base[d] + bias[vocab if parent == 0 else token], -1)

    tree = build_tree(torch.log_softmax(base, -1), 99, budget=budget, conditional=conditional)
    scores = {}
    for n in range(1, depth + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            lp, prev = 0.0, None
            for d, t in enumerate(prefix):
                lp += float(torch.log_softmax(base[d] + bias[vocab if prev is None else prev], -1)[t])
                prev = t
            scores[prefix] = lp
    best = sorted(scores, key=lambda p: -scores[p])[:budget]
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()

    def prefix_of(i: int) -> tuple[int, ...]:
        out = []
        while i > 0:
            out.append(toks[i])
            i = parents[i]
        return tuple(reversed(out))

    got = [prefix_of(i) for i in range(1, tree.size)]
    assert set(got) == set(best) and len(got) == budget
    for i in range(1, tree.size):
        torch.testing.assert_close(float(tree.log_probs[i]), scores[prefix_of(i)], rtol=1e-5, atol=1e-5)
    flat = build_tree(torch.log_softmax(base, -1), 99, budget=budget)
    same = build_tree(
        torch.log_softmax(base, -1), 99, budget=budget, conditional=lambda d, p, t, u: torch.log_softmax(base[d], -1)
    )
    assert torch.equal(flat.tokens, same.tokens) and torch.equal(flat.parents, same.parents)
