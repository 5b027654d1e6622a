"""Decoding with DFlash2 drafters: greedy output equals the target's own greedy decoding (chain and DDTree, several
block sizes, a reduced vocabulary), drafts are the candidate selector's walk as a float64 Python loop computes it
from the raw parameters, DDTree over the selector lattice holds exactly the most probable prefixes of the walk's
distribution (brute force), and sampling at T > 0 with the sparse q reproduces the target's joint distribution of
three tokens (argmax and sampled drafts; a wrong acceptance rule fails the same test)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.decode.tree import build_tree
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import dflash2_draft
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import Target
from helpers.joint_law import check_joint_law, tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dflash2_config(vocab: int = 97, bs: int = 4, hidden: int = 64, layers: int = 8, **kw) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        num_target_layers=layers,
        target_layer_ids=[1, 4, 6] if layers == 8 else [0, layers - 1],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        block_size=bs,
        mask_token_id=min(5, vocab - 1),
        kind="dflash2",
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=kw.pop("selector_top_k", 4),
        **kw,
    )


def random_dflash2(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Random weights everywhere, convolutions and selector included (large enough to change the drafts)."""
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for layer in d.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(0, 0.5)
                conv.kernel_projection.weight.normal_(0, 0.2)
        sel = d.candidate_selector
        sel.predecessor_codebook.normal_(0, 1.0)
        sel.successor_codebook.normal_(0, 1.0)
        sel.hidden_projection.weight.normal_(0, 1.0)
        if cfg.draft_vocab_size:
            d.draft_to_target.copy_(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values)
    return d


@pytest.fixture(scope="module")
def target(tiny_llama_dir) -> Target:
    return Target.load(tiny_llama_dir)


def _walk64(d: DFlashDrafter, hidden: torch.Tensor, unary: torch.Tensor, first: int) -> list[int]:
    """The selector's greedy walk in float64 Python loops, from the raw parameters (target ids out)."""
    sel, cfg = d.candidate_selector, d.config
    a, b = sel.predecessor_codebook.detach().double(), sel.successor_codebook.detach().double()
    p = sel.hidden_projection.weight.detach().double()
    to_target = (lambda i: i) if cfg.draft_vocab_size is None else (lambda i: int(d.draft_to_target[i]))
    prev, out = first, []
    for j in range(unary.shape[0]):
        u = unary[j].double().tolist()
        cands = sorted(range(len(u)), key=lambda c: -u[c])[: sel.top_k]
        ph = [sum(p[r, i] * hidden[j, i].double() for i in range(hidden.shape[1])) for r in range(p.shape[0])]
        best, best_s = None, -math.inf
        for c in cands:
            s = u[c] + sum(float(a[prev, r] * ph[r] * b[c, r]) for r in range(p.shape[0]))
            if s > best_s:
                best, best_s = c, s
        prev = to_target(best)
        out.append(prev)
    return out


def test_drafts_are_the_selector_walk(target: Target, monkeypatch) -> None:
    for vocab in (None, 40):
        drafter = random_dflash2(dflash2_config(bs=5, draft_vocab_size=vocab), seed=3)
        seen = []
        real = dflash2_draft.draft_dflash2

        def spy(r, real=real, seen=seen):
            out = real(r)
            seen.append((r.bonus, out))
            return out

        monkeypatch.setattr(dflash2_draft, "draft_dflash2", spy)
        generate(target, torch.tensor([3, 4, 5, 6]), drafter=drafter, settings=DecodeSettings(max_new_tokens=12))
        assert seen
        differs = False
        for bonus, (drafts, q, unary, hidden) in seen:
            assert q is None
            assert drafts.tolist() == _walk64(drafter, hidden, unary, bonus)
            differs |= drafts.tolist() != drafter.to_target_ids(unary.argmax(-1)).tolist()
        assert differs, "the selector never changed a draft: the test would not see a missing selector"


def test_ddtree_over_the_selector_lattice_holds_the_most_probable_prefixes() -> None:
    """Brute force over every path of candidates: the tree's nodes are the top-B prefixes of the walk distribution
    P(x_1..x_d) = Π_j softmax_C_j(S_j(x_{j−1}, ·))[x_j]."""
    cfg = dflash2_config(vocab=30, bs=4, selector_top_k=3)
    d = random_dflash2(cfg, seed=5)
    g = torch.Generator().manual_seed(0)
    hidden, unary = torch.randn(3, 64, generator=g), torch.randn(3, 30, generator=g) * 2
    root = 7
    cond = dflash2_draft.lattice_conditional(d, hidden, unary)
    budget = 8
    tree = build_tree(torch.log_softmax(unary, -1), root, budget=budget, conditional=cond)
    prefixes = {}
    cand = unary.topk(3, dim=-1).indices.tolist()
    for depth in (1, 2, 3):
        for path in itertools.product(*[cand[j] for j in range(depth)]):
            lp, prev = 0.0, root
            for j, x in enumerate(path):
                sc = d.candidate_selector.scores(
                    unary[j].double(), hidden[j], torch.tensor(prev), torch.tensor(cand[j])
                )
                lp += float(torch.log_softmax(sc.detach().double(), -1)[cand[j].index(x)])
                prev = x
            prefixes[path] = lp
    best = sorted(prefixes.values(), reverse=True)[:budget]
    got = sorted(tree.log_probs[1:].tolist(), reverse=True)
    assert got == pytest.approx(best, abs=1e-5)
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    for n in range(1, len(toks)):  # every node is a candidate of its depth
        assert toks[n] in cand[int(tree.depths[n]) - 1]
    assert len(toks) == budget + 1 and parents[0] == -1


def test_sampling_with_the_sparse_q_matches_the_targets_joint_distribution() -> None:
    """Tokens 2 and 3 come from one round of two selector-walk drafts over top-2 candidates of a vocabulary of 3 (so
    the target's third token is reachable only through the residual)."""
    check_joint_law(
        tiny_target(), random_dflash2(dflash2_config(vocab=3, bs=3, hidden=32, layers=2, selector_top_k=2), seed=1)
    )
