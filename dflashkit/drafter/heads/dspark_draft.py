"""One DSpark drafting round: the backbone pass over [bonus, MASK × (bs − 1)], then the Markov head left to right.

Every slot drafts: slot k proposes the token at start + k + 1, from the backbone's logits of slot k plus the Markov
bias of the token before it (the bonus for slot 0, the draft of slot k − 1 after). Drafts are the argmax of those
corrected logits, or — with draft sampling at temperature > 0 — samples from them; the corrected logits are then the
draft distribution q_k (conditional on the earlier drafts), which is what the min(1, p/q) rule needs to stay
lossless. With `confidence_min` the round keeps only the drafts whose predicted prefix acceptance — the product of
the confidence head's sigmoid over the slots so far (DeepSpec's reading) — is at least that value (possibly none: the
round then verifies the bonus alone, as an AR step).

DDTree over DSpark drafts (`dspark_conditional`): a node's children are ranked by the Markov-corrected distribution
given the node's own token, so the tree holds the most probable prefixes of the drafter's autoregressive
distribution (tree.build_tree); verification is the ordinary, exact tree verification.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.heads.base import DraftRound, q_over_target
from dflashkit.sampling import probs, sample


def draft_dspark(r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor]:
    """(drafts (n,) target ids, q over the target vocabulary (n, V) when drafts are sampled else None, the backbone's
    logits (n_verify, V') before the Markov correction), n ≤ n_verify (fewer when the confidence cut-off stops)."""
    target, drafter, bonus, bs = r.target, r.drafter, r.bonus, r.block_size
    sampling, confidence_min = r.sampling, r.confidence_min
    embeds = drafter.block_embeddings(torch.tensor([[bonus]]), target.embed_weight, bs)
    positions = torch.arange(r.start, r.start + bs)[None]
    hidden = drafter(r.new_ctx, embeds, context_positions=r.new_pos, block_positions=positions, cache=r.cache)
    hidden = hidden[0, : r.n_verify]  # (n, H)
    base = drafter.logits(hidden, target.lm_head_weight).float()  # (n, V')
    head = drafter.markov_head
    conf_head = getattr(drafter, "confidence_head", None) if confidence_min is not None else None
    sampled = not sampling.greedy and r.draft_sampling
    prev, prefix = int(bonus), 1.0
    drafts, qs = [], []
    for k in range(base.shape[0]):
        prev_t = torch.tensor([prev])
        if conf_head is not None:
            prefix *= float(torch.sigmoid(conf_head(hidden[k : k + 1], head.prev_embeddings(prev_t)).float()))
            if prefix < confidence_min:
                break
        row = base[k] + head.bias(prev_t)[0].float()  # (V',)
        if sampled:
            q = probs(row, sampling)
            pick = int(sample(q, r.generator))
            qs.append(q)
        else:
            pick = int(row.argmax())
        prev = int(drafter.to_target_ids(torch.tensor(pick)))
        drafts.append(prev)
    draft_q = None
    if sampled:
        draft_q = q_over_target(drafter, torch.stack(qs) if qs else base[:0], target.vocab_size)
    return torch.tensor(drafts, dtype=torch.long), draft_q, base


def dspark_conditional(base_logits: Tensor, drafter: Any) -> Callable[[int, int, int, int], Tensor]:
    """For `build_tree(conditional=…)`: (depth d, parent node, parent token, its parent) →
    log-softmax(base_d + W2·W1[prev]) (V'), prev = the parent's target id (node 0 holds the bonus, a target id; the
    others hold draft ids)."""
    head = drafter.markov_head

    def conditional(d: int, parent: int, token: int, _up: int) -> Tensor:
        prev = token if parent == 0 else int(drafter.to_target_ids(torch.tensor(token)))
        return torch.log_softmax(base_logits[d] + head.bias(torch.tensor(prev)).float(), dim=-1)

    return conditional


__all__ = ["draft_dspark", "dspark_conditional"]
