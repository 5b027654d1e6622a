"""Decoding with Domino drafters: greedy output equals the target's own greedy decoding (chain and DDTree, several
block sizes, a reduced vocabulary), drafts are the corrected rollout as a float64 Python loop computes it from the
raw GRU and projection weights, a round proposes bs drafts, DDTree holds exactly the most probable prefixes of the
rollout's distribution (brute force over every path), and sampling at T > 0 reproduces the target's joint
distribution of three tokens (argmax and sampled drafts; a wrong acceptance rule fails the same test)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.decode.tree import build_tree
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import domino_draft
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import Target
from helpers.domino_reference import corrected64, gru64, weights64
from helpers.joint_law import check_joint_law, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def domino_config(vocab: int = 97, bs: int = 4, hidden: int = 64, layers: int = 8, **kw) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden, vocab_size=vocab, num_target_layers=layers,
        target_layer_ids=[1, 4, 6] if layers == 8 else [0, layers - 1], num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=bs, mask_token_id=min(5, vocab - 1),
        kind="domino", gru_hidden_dim=12, emb_dim=10, **kw,
    )  # fmt: skip


def random_domino(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Random weights with a correction large enough to change the drafts."""
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for p in d.prefix_gru.parameters():
            p.normal_(0, 0.5)
        d.embed_proj[0].weight.normal_(0, 0.5)
        d.embed_proj[2].weight.normal_(0, 2.0)
        if cfg.draft_vocab_size:
            d.draft_to_target.copy_(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return d


def rollout64(d, base, hidden, first: int, embed) -> list[int]:
    """Greedy drafts (target ids) of the corrected rollout in float64."""
    to_target = (lambda i: i) if d.config.draft_vocab_size is None else (lambda i: int(d.draft_to_target[i]))
    w, prevs, out = weights64(d), [first], []
    for k in range(base.shape[0]):
        state = gru64(w, [embed[p] for p in prevs])[-1]
        pick = to_target(int(corrected64(w, k, base[k], hidden[k], state).argmax()))
        out.append(pick)
        prevs.append(pick)
    return out


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> Target:
    return Target.load(tiny_llama_dir)


def test_drafts_are_the_corrected_rollout(target: Target, monkeypatch) -> None:
    for vocab, prefix in ((None, 1), (40, 0), (None, 2)):
        drafter = random_domino(domino_config(bs=5, draft_vocab_size=vocab, pure_draft_prefix_len=prefix), seed=3)
        seen = []
        real = domino_draft.draft_domino

        def spy(r, real=real, seen=seen):
            out = real(r)
            seen.append((r.bonus, out))
            return out

        monkeypatch.setattr(domino_draft, "draft_domino", spy)
        generate(target, torch.tensor([3, 4, 5, 6]), drafter=drafter, settings=DecodeSettings(max_new_tokens=12))
        assert seen
        differs = False
        for bonus, (drafts, q, base, hidden) in seen:
            assert q is None and drafts.numel() == base.shape[0] == hidden.shape[0]
            assert drafts.tolist() == rollout64(drafter, base, hidden, bonus, target.embed_weight)
            differs |= drafts.tolist() != drafter.to_target_ids(base.argmax(-1)).tolist()
        assert differs, "the correction never changed a draft: the test would not see a missing correction"
        assert seen[0][1][0].numel() == 5  # every slot drafts: bs drafts in the first round


def test_ddtree_holds_the_most_probable_prefixes_of_the_rollout() -> None:
    """Brute force over every path of depth ≤ 3: the tree's nodes are the top-B prefixes of
    P(x_1..x_d) = Π_k softmax(z_k(x_0..x_{k−1}))[x_k], the GRU state carried along each path."""
    vocab = 6
    d = random_domino(domino_config(vocab=vocab, bs=3, hidden=32, layers=2), seed=5)
    g = torch.Generator().manual_seed(0)
    base, hidden = torch.randn(3, vocab, generator=g) * 2, torch.randn(3, 32, generator=g)
    embed = torch.randn(vocab, 32, generator=g)
    root, budget = 2, 9
    cond = domino_draft.domino_conditional(d, base, hidden, embed)
    tree = build_tree(torch.log_softmax(base, -1), root, budget=budget, top_k=vocab, conditional=cond)
    prefixes, w = {}, weights64(d)
    for depth in (1, 2, 3):
        for path in itertools.product(range(vocab), repeat=depth):
            lp, prevs = 0.0, [root]
            for k, x in enumerate(path):
                state = gru64(w, [embed[p] for p in prevs])[-1]
                lp += float(torch.log_softmax(corrected64(w, k, base[k], hidden[k], state), -1)[x])
                prevs.append(x)
            prefixes[path] = lp
    best = sorted(prefixes.values(), reverse=True)[:budget]
    got = sorted(tree.log_probs[1:].tolist(), reverse=True)
    assert got == pytest.approx(best, abs=1e-5)
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    for n in range(1, len(toks)):  # each node's log-prob is its own path's
        path, m = [], n
        while m > 0:
            path.insert(0, toks[m])
            m = parents[m]
        assert float(tree.log_probs[n]) == pytest.approx(prefixes[tuple(path)], abs=1e-5)


def test_sampling_matches_the_targets_joint_distribution_of_three_tokens() -> None:
    """Tokens 2 and 3 come from one round of drafts whose q is the corrected distribution given the sampled ones."""
    target = tiny_target()
    drafter = random_domino(domino_config(vocab=3, bs=2, hidden=32, layers=2, pure_draft_prefix_len=0), seed=1)
    check_joint_law(target, drafter)
