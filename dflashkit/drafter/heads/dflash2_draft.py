"""DFlash2's drafting: the candidate selector's walk over a block, and its lattice for DDTree.

One round: the backbone pass over [bonus, MASK × (bs − 1)], unary logits U_j of draft slots j = 1 … n (the LM head's,
scaled as `scaled_logits`), candidates C_j = top-K(U_j), then left to right with p_1 = the bonus token:

    S_j(c) = U_j[c] + ⟨A[p_j] ⊙ P·h_j, B[c]⟩   for c ∈ C_j
    greedy:  x_j = argmax_c S_j(c)            T > 0:  x_j ~ q_j = softmax(S_j / T) over C_j (0 elsewhere)
    p_{j+1} = x_j

q_j is the distribution the draft was sampled from given the earlier drafts, so the min(1, p/q) rule with this
sparse q keeps decoding lossless. Scores outside C_j are −inf in the dense rows this module returns (no draft can
take them): `walk_scores` for llama.cpp's check and doctor, `lattice_conditional` for DDTree, where each node ranks
its children by S given its own token — the tree holds the most probable prefixes of the selector's walk
distribution, and verification stays the ordinary exact tree verification.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.heads.base import q_over_target
from dflashkit.sampling import sample


def _target_id(drafter: Any, draft_id: int) -> int:
    return int(drafter.to_target_ids(torch.tensor(draft_id)))


@torch.no_grad()
def walk(
    drafter: Any, hidden: Tensor, unary: Tensor, first_prev: int, *, temperature: float = 0.0, generator: Any = None
) -> tuple[list[int], Tensor | None, Tensor]:
    """hidden (n, H), unary (n, V') → (drafts as target ids, q (n, V') over draft ids when sampled else None,
    the dense scores (n, V') the drafts were chosen from, −inf outside each slot's candidates)."""
    sel = drafter.candidate_selector
    cand = sel.candidates(unary)  # (n, K) draft ids
    ctx_h = sel.hidden_projection(hidden.to(sel.hidden_projection.weight.dtype))  # (n, r)
    succ = sel.successor_codebook[cand]  # (n, K, r)
    dense = torch.full_like(unary, float("-inf"))
    prev, drafts, qs = int(first_prev), [], []
    for j in range(unary.shape[0]):
        pair = (sel.predecessor_codebook[prev] * ctx_h[j]) @ succ[j].t()  # (K,)
        scores = unary[j, cand[j]] + pair.to(unary.dtype)  # (K,)
        dense[j, cand[j]] = scores
        if temperature > 0:
            q = torch.softmax(scores / temperature, dim=-1)  # (K,)
            pick = int(sample(q, generator))
            qs.append(torch.zeros_like(unary[j]).index_copy_(0, cand[j], q))
        else:
            pick = int(scores.argmax())
        prev = _target_id(drafter, int(cand[j, pick]))
        drafts.append(prev)
    q_rows = torch.stack(qs) if qs else (None if temperature <= 0 else unary[:0])
    return drafts, q_rows, dense


@torch.no_grad()
def teacher_forced_scores(drafter: Any, hidden: Tensor, unary: Tensor, prev_tokens: Tensor) -> Tensor:
    """Dense scores (n, V') of slot j given the true token before it (`prev_tokens[j]`, target ids); −inf outside
    each slot's candidates."""
    sel = drafter.candidate_selector
    cand = sel.candidates(unary)  # (n, K)
    scores = sel.scores(unary, hidden, prev_tokens, cand)  # (n, K)
    return torch.full_like(unary, float("-inf")).scatter_(-1, cand, scores)


def lattice_conditional(drafter: Any, hidden: Tensor, unary: Tensor) -> Callable[[int, int, int, int], Tensor]:
    """For `build_tree(conditional=…)`: (depth d, parent node, parent token, its parent) → log-softmax of S_d given
    that token over C_d (−inf elsewhere, V'); the parent token is the bonus (a target id) at node 0, a draft id
    below."""
    sel = drafter.candidate_selector
    cand = sel.candidates(unary)  # (D, K)

    @torch.no_grad()
    def conditional(d: int, parent: int, token: int, _up: int) -> Tensor:
        prev = token if parent == 0 else _target_id(drafter, token)
        scores = sel.scores(unary[d], hidden[d], torch.tensor(prev), cand[d])  # (K,)
        row = torch.full_like(unary[d], float("-inf"))
        return row.index_copy_(0, cand[d], torch.log_softmax(scores.float(), dim=-1))

    return conditional


def draft_dflash2(r: Any) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """One round (`DraftRound` r) → (drafts (n,) target ids, q over the target vocabulary (n, V) when sampled else
    None, the unary logits (n, V'), the slots' hidden states (n, H))."""
    drafter, target = r.drafter, r.target
    embeds = drafter.block_embeddings(torch.tensor([[r.bonus]]), target.embed_weight, r.block_size)
    positions = torch.arange(r.start, r.start + r.block_size)[None]
    out = drafter(r.new_ctx, embeds, context_positions=r.new_pos, block_positions=positions, cache=r.cache)
    hidden = out[0, 1 : r.n_verify + 1]  # (n, H)
    unary = drafter.logits(hidden, target.lm_head_weight).float()  # (n, V')
    sampled = not r.sampling.greedy and r.draft_sampling
    temperature = float(r.sampling.temperature) if sampled else 0.0
    drafts, q, _ = walk(drafter, hidden, unary, r.bonus, temperature=temperature, generator=r.generator)
    q = None if q is None else q_over_target(drafter, q, target.vocab_size)
    return torch.tensor(drafts, dtype=torch.long), q, unary, hidden


__all__ = ["draft_dflash2", "lattice_conditional", "teacher_forced_scores", "walk"]
