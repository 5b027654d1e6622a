"""XPress's drafting: one backbone pass over [bonus, MASK × (bs − 1)], then K Jacobi passes of the refiner
(`xpress_net.jacobi`) — serial depth K, not bs.

Greedy drafts are the last pass's argmax. With draft sampling at T > 0 the passes before the last read argmaxes
(deterministic given the context), and the drafts are sampled from softmax(last pass's row / T): each draft's
distribution is then fixed before any draft is drawn, so it is exactly the q of the min(1, p/q) rule and sampling
stays lossless.

Slot 0 of a block holds the bonus; its previous token is the token before the bonus (as in training: the data token
before the anchor). DDTree ranks children by the last pass's per-depth marginals (the refined rows do not change
along a path: the passes read their own guesses, not the tree's).

Callers that ran the backbone themselves (simulation, the llama.cpp check, doctor) pass the draft slots' backbone
logits and the whole block (`BlockSlots`): slot k's refined row depends only on the guesses of slots before it and
on the block's hidden states, so rows past the draft slots given are filled with zeros without changing them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.heads.base import BlockSlots, DraftRound, q_over_target
from dflashkit.drafter.heads.xpress_net import jacobi, refined_logits
from dflashkit.sampling import probs, sample


def _whole_block(draft_logits: Tensor, bs: int) -> Tensor:
    """Draft slots' logits (n, V') → (1, bs, V'): slot 0 (its guess is replaced by the given token) and slots past
    the n given ones zero."""
    full = draft_logits.new_zeros(1, bs, draft_logits.shape[-1]).float()
    full[0, 1 : 1 + draft_logits.shape[0]] = draft_logits.float()
    return full


def refined_rows(drafter: Any, draft_logits: Tensor, first: int, block: BlockSlots) -> Tensor:
    """The last Jacobi pass's rows (n, V') of the draft slots (the backbone's with num_jacobi_passes 0)."""
    if block is None:
        raise ValueError("an XPress drafter's drafts need the whole block (`block`): its refiner reads every slot")
    n, bs = draft_logits.shape[0], drafter.config.block_size
    cache = drafter.refiner_head.hidden_cache(block.hidden[None])  # (1, bs, 2r)
    dev = draft_logits.device
    first_t, before_t = torch.tensor([int(first)], device=dev), torch.tensor([int(block.before)], device=dev)
    n_passes = drafter.config.head_settings.num_jacobi_passes
    passes = jacobi(drafter, _whole_block(draft_logits, bs), cache, first_t, before_t, n_passes)
    return passes[-1][0, 1 : 1 + n] if passes else draft_logits.float()


def draft_xpress(r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """(drafts (nv,) target ids, q over the target vocabulary (nv, V) when sampled else None, the last pass's rows
    (nv, V'), the draft slots' hidden states (nv, H)); nv = r.n_verify."""
    drafter, target = r.drafter, r.target
    embeds = drafter.block_embeddings(torch.tensor([[r.bonus]]), target.embed_weight, r.block_size)
    positions = torch.arange(r.start, r.start + r.block_size)[None]
    hidden = drafter(r.new_ctx, embeds, context_positions=r.new_pos, block_positions=positions, cache=r.cache)[0]
    base = drafter.logits(hidden[1 : r.n_verify + 1], target.lm_head_weight).float()  # (nv, V'): as simulation
    before = r.bonus if r.before is None else r.before
    rows = refined_rows(drafter, base, r.bonus, BlockSlots(hidden, r.bonus, before))  # (nv, V')
    draft_hidden = hidden[1 : r.n_verify + 1]
    if r.sampling.greedy or not r.draft_sampling:
        return drafter.to_target_ids(rows.argmax(-1)), None, rows, draft_hidden
    q = probs(rows, r.sampling)
    drafts = drafter.to_target_ids(sample(q, r.generator))
    return drafts, q_over_target(drafter, q, target.vocab_size), rows, draft_hidden


def greedy_chain(drafter: Any, draft_logits: Tensor, first: int, block: BlockSlots) -> tuple[list[int], Tensor]:
    """(greedy drafts as target ids, the rows (n, V') they are the argmax of) from the draft slots' backbone logits."""
    rows = refined_rows(drafter, draft_logits, first, block)
    return drafter.to_target_ids(rows.argmax(-1)).tolist(), rows


def marginal_conditional(drafter: Any, draft_logits: Tensor, block: BlockSlots | None) -> Callable | None:
    """For `build_tree`: the last pass's log-softmax at each depth (None where the rows are `draft_logits` already:
    `draft_xpress` returned them)."""
    if block is None:
        return None
    logp = torch.log_softmax(refined_rows(drafter, draft_logits, int(block.first), block), dim=-1)  # (n, V')
    return lambda d, node, token, parent: logp[d]


def teacher_forced(drafter: Any, draft_logits: Tensor, prev_tokens: Tensor, block: BlockSlots) -> Tensor:
    """Draft slot j's refined row (n, V') when the token before it is `prev_tokens[j]` (target ids): one pass."""
    if block is None:
        raise ValueError("an XPress drafter's scores need the whole block (`block`): its refiner reads every slot")
    n, bs = draft_logits.shape[0], drafter.config.block_size
    prev = torch.zeros(1, bs, dtype=torch.long, device=draft_logits.device)
    prev[0, 0] = int(block.before)
    prev[0, 1 : 1 + n] = prev_tokens.reshape(-1)[:n].to(prev.device)
    cache = drafter.refiner_head.hidden_cache(block.hidden[None])  # (1, bs, 2r)
    return refined_logits(drafter, _whole_block(draft_logits, bs), prev, cache)[0, 1 : 1 + n]


__all__ = ["draft_xpress", "greedy_chain", "marginal_conditional", "refined_rows", "teacher_forced"]
