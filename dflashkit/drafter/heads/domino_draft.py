"""Domino's drafting: one backbone pass over [bonus, MASK × (bs − 1)], then the correction head left to right.

Every slot drafts: slot k proposes the token at start + k + 1 from its base logits plus the correction of the GRU state
after the bonus and the drafts before it (`domino_net`). Drafts are the argmax of the corrected row, or — with draft
sampling at T > 0 — a sample of softmax(row / T); that distribution, conditional on the earlier drafts, is the q of
the min(1, p/q) rule, so sampling stays lossless (as for DSpark).

DDTree (`domino_conditional`): a node's children are ranked by the corrected distribution given the whole path from
the root to that node (the GRU state is carried from each node to its children), so the tree holds the most probable
prefixes of the drafter's own autoregressive distribution; verification is the ordinary tree verification.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.heads.base import DraftRound, q_over_target
from dflashkit.drafter.heads.domino_net import PrefixWalk, corrected_logits, token_embeddings
from dflashkit.sampling import probs, sample


def draft_domino(r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """(drafts (n,) target ids, q over the target vocabulary (n, V) when sampled else None, the backbone's logits
    (n, V') before the correction, the slots' hidden states (n, H)); n = r.n_verify."""
    drafter, target = r.drafter, r.target
    embeds = drafter.block_embeddings(torch.tensor([[r.bonus]]), target.embed_weight, r.block_size)
    positions = torch.arange(r.start, r.start + r.block_size)[None]
    hidden = drafter(r.new_ctx, embeds, context_positions=r.new_pos, block_positions=positions, cache=r.cache)
    hidden = hidden[0, : r.n_verify]  # (n, H): every slot drafts
    base = drafter.logits(hidden, target.lm_head_weight).float()  # (n, V')
    sampled = not r.sampling.greedy and r.draft_sampling
    walk, prev = PrefixWalk(drafter, target.embed_weight), int(r.bonus)
    drafts, qs = [], []
    for k in range(base.shape[0]):
        walk = walk.step(prev)
        row = walk.logits(k, base[k], hidden[k])  # (V',)
        if sampled:
            q = probs(row, r.sampling)
            qs.append(q)
            pick = int(sample(q, r.generator))
        else:
            pick = int(row.argmax())
        prev = int(drafter.to_target_ids(torch.tensor(pick)))
        drafts.append(prev)
    draft_q = None
    if sampled:
        draft_q = q_over_target(drafter, torch.stack(qs) if qs else base[:0], target.vocab_size)
    return torch.tensor(drafts, dtype=torch.long), draft_q, base, hidden


def greedy_chain(drafter: Any, base: Tensor, first_prev: int, hidden: Tensor, embed_weight: Tensor) -> tuple:
    """(greedy drafts as target ids, the corrected rows (n, V') they are the argmax of) from a block's base logits."""
    walk, prev = PrefixWalk(drafter, embed_weight), int(first_prev)
    drafts, rows = [], []
    for k in range(base.shape[0]):
        walk = walk.step(prev)
        rows.append(walk.logits(k, base[k].float(), hidden[k]))
        prev = int(drafter.to_target_ids(rows[-1].argmax()))
        drafts.append(prev)
    return drafts, torch.stack(rows) if rows else base[:0].float()


def teacher_forced(drafter: Any, base: Tensor, prev_tokens: Tensor, hidden: Tensor, embed_weight: Tensor) -> Tensor:
    """Slot j's corrected logits (n, V') when the tokens before the slots are `prev_tokens` (n,) target ids."""
    embeds = token_embeddings(drafter, prev_tokens.reshape(1, -1), embed_weight)  # (1, n, H)
    return corrected_logits(drafter, base[None].float(), hidden[None], embeds)[0].float()


def domino_conditional(
    drafter: Any, base: Tensor, hidden: Tensor, embed_weight: Tensor
) -> Callable[[int, int, int, int], Tensor]:
    """For `build_tree(conditional=…)`: (depth d, node, its token, its parent node) → log-softmax of slot d's
    corrected row given the path from the root to the node (V'). Node 0 holds the bonus (a target id), the others
    draft ids; each node's GRU state is its parent's after reading the node's own token."""
    walks: dict[int, PrefixWalk] = {}

    def conditional(d: int, node: int, token: int, parent: int) -> Tensor:
        if node not in walks:
            prev = token if node == 0 else int(drafter.to_target_ids(torch.tensor(token)))
            before = PrefixWalk(drafter, embed_weight) if node == 0 else walks[parent]
            walks[node] = before.step(prev)
        return torch.log_softmax(walks[node].logits(d, base[d].float(), hidden[d]), dim=-1)

    return conditional


__all__ = ["domino_conditional", "draft_domino", "greedy_chain", "teacher_forced"]
