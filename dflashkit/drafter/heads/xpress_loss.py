"""XPress's training objective (speculators' XPress trainer): the refined logits given the data's previous tokens,
free-running rounds that read the refiner's own guesses, and an anchor on the backbone's own logits.

    loss = L(z_tf) + consistency_weight · mean_j L(z_j) + base_anchor_weight · L(h·Wᵀ)
    z_tf = h·Wᵀ + R·x(t_data)          slot k's previous token: the data token at a + k − 1 (slot 0: the one before
                                        the anchor, or the anchor itself at a document's start)
    z_j  = h·Wᵀ + R·x(guess_{j−1})     guess_{−1} = argmax of h·Wᵀ, guess_j = argmax of z_j (slot 0: the anchor),
                                        no gradient through a guess (an argmax) — the recurrence of Jacobi decoding

L is the run's configured objective over the step's labels, slot weights and normaliser (`TrainingTerms.
backbone_loss`): with a distribution loss (tv, kl, …) it is (1 − xpress_ce_weight)·L_loss + xpress_ce_weight·CE —
speculators' {"ce": 0.1, "tv": 0.9} for loss: tv with labels: target (speculators' CE label is the target's argmax).
Since z = [h ; x]·[W ; R]ᵀ, each term is that objective over the states [h ; x] with the frozen rows W and the trained
rows R, chunked as the backbone's own loss is (no (rows, V') logits, no gradient formed for W).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from dflashkit.drafter.heads.base import HeadObjective, TrainingTerms

_CHUNK_LOGITS = 1 << 25  # rows × vocabulary per argmax chunk


def _compound(terms: TrainingTerms, alpha: float, states: Tensor, rows: Tensor, extra: Tensor | None = None) -> Any:
    """The configured objective, with XPress's CE share `alpha` (its xpress_ce_weight) under a distribution loss (a
    LossOutput)."""
    out = terms.backbone_loss(states, rows, extra=extra)
    if terms.train_cfg.loss == "ce" or alpha == 0:
        return out
    ce = terms.backbone_loss(states, rows, kind="ce", extra=extra)
    return dataclasses.replace(out, loss=(1 - alpha) * out.loss + alpha * ce.loss)


@torch.no_grad()
def _guesses(drafter: Any, h: Tensor, w: Tensor, x: Tensor | None = None, r: Tensor | None = None) -> Tensor:
    """The argmax (N, bs), as target ids, of h·wᵀ (+ x·rᵀ): h (N, bs, H), w (V', H), x (N, bs, r), r (V', r); a
    few blocks at a time."""
    n, bs, _ = h.shape
    step = max(1, _CHUNK_LOGITS // max(1, bs * w.shape[0]))
    parts = []
    for i in range(0, n, step):
        z = h[i : i + step].reshape(-1, h.shape[-1]).to(w.dtype) @ w.t()  # (n_c·bs, V')
        if x is not None:
            z = z.float().addmm_(x[i : i + step].reshape(-1, x.shape[-1]).float(), r.t().float())
        parts.append(z.argmax(-1).view(-1, bs))
    return drafter.to_target_ids(torch.cat(parts)) if parts else h.new_zeros(0, bs, dtype=torch.long)


def xpress_objective(terms: TrainingTerms, options: Any) -> HeadObjective:
    """The module docstring's loss (normalised as the backbone's) under the training options (`XPressTrainSettings`),
    with the teacher-forced term's per-slot counts."""
    drafter, alpha = terms.drafter, options.xpress_ce_weight
    refiner = drafter.refiner_head
    h = terms.hidden  # (N, bs, H)
    w = terms.head_weight.detach()  # (V', H), frozen
    readout = refiner.readout.weight  # (V', r), trained
    cache = refiner.hidden_cache(h)  # (N, bs, 2r)
    prev = terms.prev_tokens.to(h.device)  # (N, bs) target ids

    def states(x: Tensor) -> Tensor:  # (N, bs, H + r)
        return torch.cat([h, x.to(h.dtype)], dim=-1)

    tf = _compound(terms, alpha, states(refiner.features(prev, cache)), w, readout)
    loss = tf.loss
    if options.consistency_weight > 0 and options.consistency_passes > 0:
        before, anchor = prev[:, :1], prev[:, 1:2]  # slot 0's previous token, the anchor (slot 1's)
        guess = _guesses(drafter, h, w)
        rounds = []
        for _ in range(options.consistency_passes):
            guess = torch.cat([anchor, guess[:, 1:]], dim=1)
            x = refiner.features(torch.cat([before, guess[:, :-1]], dim=1), cache)  # (N, bs, r)
            rounds.append(_compound(terms, alpha, states(x), w, readout).loss)
            guess = _guesses(drafter, h, w, x, readout)
        loss = loss + options.consistency_weight * torch.stack(rounds).mean()
    if options.base_anchor_weight > 0:
        loss = loss + options.base_anchor_weight * _compound(terms, alpha, h, w).loss
    return HeadObjective(loss=loss, correct_counts=tf.correct_counts, valid_counts=tf.valid_counts)


__all__ = ["xpress_objective"]
