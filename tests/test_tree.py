"""Tests of dflashkit.tree: DDTree construction, tree attention masks, position ids and tree acceptance."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dflashkit.tree import (
    DraftTree,
    build_tree,
    chain_tree,
    follow_tree,
    tree_attention_mask,
    tree_position_ids,
)


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
        assert set(pre[len(spine):]) == set(rest[: budget - len(spine)])


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
        build_tree(lp, 9, budget=3, top_k=0)
    with pytest.raises(ValueError):
        build_tree(lp[0], 9, budget=3, top_k=2)


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
        for a, b in zip(path, path[1:]):
            assert parents[b] == a and toks[b] == target[a].item()
        last = path[-1]
        assert all(toks[c] != target[last].item() for c in tree.children(last))
