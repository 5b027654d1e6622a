"""XPress's training objective (speculators' XPress trainer): the refined logits given the data's previous tokens,
free-running rounds that read the refiner's own guesses, and an anchor on the backbone's own logits.

    loss = L(z_tf) + consistency_weight · mean_j L(z_j) + base_anchor_weight · L(h·Wᵀ)
    z_tf = h·Wᵀ + R·x(t_data)          slot k's previous token: the data token at a + k − 1 (slot 0: the one before
                                        the anchor, or the anchor itself at a document's start)
    z_j  = h·Wᵀ + R·x(guess_{j−1})     guess_{−1} = argmax of h·Wᵀ, guess_j = argmax of z_j (slot 0: the anchor),
                                        no gradient through a guess (an argmax) — the recurrence of Jacobi decoding

L is the run's configured objective over the step's labels, slot weights and normaliser (`TrainingTerms.
backbone_loss`): with a distribution loss (tv, kl, …) it is (1 − xpress_ce_weight)·L_loss + xpress_ce_weight·CE,
speculators' {"ce": 0.1, "tv": 0.9} for loss: tv. Since z = [h ; x]·[W ; R]ᵀ, each term is that objective over the
states [h ; x] and the rows [W ; R] (W frozen, R trained), chunked as the backbone's own loss is.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.heads.base import HeadObjective, TrainingTerms

_CHUNK_LOGITS = 1 << 25  # rows × vocabulary per argmax chunk


def _compound(terms: TrainingTerms, states: Tensor, rows: Tensor) -> Any:
    """The configured objective, with XPress's CE share under a distribution loss (a LossOutput)."""
    cfg = terms.train_cfg
    out = terms.backbone_loss(states, rows)
    alpha = cfg.xpress_ce_weight
    if cfg.loss == "ce" or alpha == 0:
        return out
    ce = terms.backbone_loss(states, rows, kind="ce")
    return dataclasses.replace(out, loss=(1 - alpha) * out.loss + alpha * ce.loss)


@torch.no_grad()
def _guesses(drafter: Any, states: Tensor, rows: Tensor) -> Tensor:
    """states (N, bs, H') · rows (V', H')ᵀ → the argmax (N, bs) as target ids, a few blocks at a time."""
    n, bs, _ = states.shape
    step = max(1, _CHUNK_LOGITS // max(1, bs * rows.shape[0]))
    parts = [(states[i : i + step].to(rows.dtype) @ rows.t()).argmax(-1) for i in range(0, n, step)]
    return drafter.to_target_ids(torch.cat(parts)) if parts else states.new_zeros(0, bs, dtype=torch.long)


def xpress_objective(terms: TrainingTerms) -> HeadObjective:
    """The module docstring's loss (normalised as the backbone's), with the teacher-forced term's per-slot counts."""
    cfg, drafter = terms.train_cfg, terms.drafter
    refiner = drafter.refiner_head
    h = terms.hidden  # (N, bs, H)
    w = terms.head_weight.detach()  # (V', H)
    rows = torch.cat([w, refiner.readout.weight.to(w.dtype)], dim=1)  # (V', H + r)
    cache = refiner.hidden_cache(h)  # (N, bs, 2r)
    prev = terms.prev_tokens.to(h.device)  # (N, bs) target ids

    def states(prev_tokens: Tensor) -> Tensor:  # (N, bs, H + r)
        return torch.cat([h, refiner.features(prev_tokens, cache).to(h.dtype)], dim=-1)

    tf = _compound(terms, states(prev), rows)
    loss = tf.loss
    if cfg.consistency_weight > 0 and cfg.consistency_passes > 0:
        before, anchor = prev[:, :1], prev[:, 1:2]  # slot 0's previous token, the anchor (slot 1's)
        guess = _guesses(drafter, h, w)
        rounds = []
        for _ in range(cfg.consistency_passes):
            guess = torch.cat([anchor, guess[:, 1:]], dim=1)
            s = states(torch.cat([before, guess[:, :-1]], dim=1))
            rounds.append(_compound(terms, s, rows).loss)
            guess = _guesses(drafter, s, rows)
        loss = loss + cfg.consistency_weight * torch.stack(rounds).mean()
    if cfg.base_anchor_weight > 0:
        loss = loss + cfg.base_anchor_weight * _compound(terms, h, w).loss
    return HeadObjective(loss=loss, correct_counts=tf.correct_counts, valid_counts=tf.valid_counts)


__all__ = ["xpress_objective"]
