"""DFlash2's selector term of the training loss: a K-way cross-entropy over each slot's unary candidates, teacher
forced (the predecessor is the data token before the slot), added to the unary objective with weight α_sel(step).

For each supervised draft slot k of a block (label y, the token at a + k; predecessor p, the token at a + k − 1):

    C        = top-K of the unary logits U = scaled(h·Wᵀ)                (W: the LM-head rows of the draft vocabulary)
    strict:  a slot whose y ∉ C contributes nothing                     (SpecForge, Model-Optimizer)
    inject:  y ∉ C replaces the K-th (weakest) candidate, so every slot has a label  (speculators)
    CE_k     = −log softmax_C(S(p, ·))[y],   S(p, c) = U[c] + ⟨A[p] ⊙ P·h, B[c]⟩
    term     = α_sel(step) · Σ_k w_k·CE_k / N       w: the unary objective's slot weights (D-PACE: from CE_k), N: the
                                                    step's normaliser, shared with the unary term

    α_sel(step) = 0 for step < selector_warmup_steps, then a linear ramp to selector_weight over selector_ramp_steps
                  (0: at once).

Gradients reach the backbone through h (both terms of S) and the selector's A, B, P; the LM head stays frozen, and the
candidates' unary logits are formed from gathered head rows without keeping them (M, K, H) for the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.drafter.heads.base import TrainingTerms
from dflashkit.drafter.heads.dflash2_net import scaled_logits

_CHUNK = 1 << 24  # elements of gathered head rows (rows × K × H) formed at once


class _CandidateLogits(torch.autograd.Function):
    """U[m, j] = h_m · W[c_mj] for a frozen W: (M, H), (V', H), (M, K) → (M, K)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, cand: Tensor) -> Tensor:  # type: ignore[override]
        m, k = cand.shape
        out = hidden.new_empty(m, k)
        step = max(1, _CHUNK // max(1, k * hidden.shape[1]))
        for s in range(0, m, step):
            rows = weight[cand[s : s + step]].to(hidden.dtype)  # (m_c, K, H)
            out[s : s + step] = torch.bmm(rows, hidden[s : s + step, :, None])[..., 0]
        ctx.save_for_backward(weight, cand)
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        weight, cand = ctx.saved_tensors
        m, k = cand.shape
        gh = grad.new_empty(m, weight.shape[1], dtype=ctx.hidden_dtype)
        step = max(1, _CHUNK // max(1, k * weight.shape[1]))
        for s in range(0, m, step):
            rows = weight[cand[s : s + step]].to(grad.dtype)  # (m_c, K, H)
            gh[s : s + step] = torch.bmm(grad[s : s + step, None, :], rows)[:, 0].to(ctx.hidden_dtype)
        return gh, None, None


def selector_weight_at(options: Any, step: int) -> float:
    """α_sel at `step` (0-based) under the training options (`DFlash2TrainSettings`): 0 during the warmup, then a
    linear ramp to selector_weight."""
    warm, ramp = int(options.selector_warmup_steps), int(options.selector_ramp_steps)
    if step < warm:
        return 0.0
    return float(options.selector_weight) * (1.0 if ramp == 0 else min(1.0, (step - warm + 1) / ramp))


@torch.no_grad()
def _candidates(hidden: Tensor, weight: Tensor, k: int) -> Tensor:
    """Top-K draft ids (M, K) of h·Wᵀ, best first (the scaling is monotone: the same set as of U)."""
    out = []
    step = max(1, _CHUNK // max(1, weight.shape[0]))
    for s in range(0, hidden.shape[0], step):
        out.append((hidden[s : s + step] @ weight.to(hidden.dtype).t()).topk(k, dim=-1).indices)
    return torch.cat(out) if out else hidden.new_zeros(0, k, dtype=torch.long)


def selector_terms(t: TrainingTerms, rule: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-slot selector CE on the (N, bs) grid, which slots count, and which slots' gold was a candidate:
    (ce (N, bs) float32, counted (N, bs) bool, gold_in_topk (N, bs) bool, the K-way scores (M, K) of live slots)."""
    sel, cfg = t.drafter.candidate_selector, t.drafter.config
    live = (t.labels >= 0) & (t.weights > 0).to(t.labels.device)[None]  # (N, bs)
    h = t.hidden[live]  # (M, H)
    y, prev = t.labels[live], t.prev_tokens[live].to(t.labels.device)  # (M,)
    k = min(sel.top_k, t.head_weight.shape[0])
    cand = _candidates(h.detach(), t.head_weight, k)  # (M, K)
    hit = cand == y[:, None]  # (M, K)
    inside = hit.any(-1)  # (M,)
    pos = hit.long().argmax(-1)  # (M,)
    if rule == "inject":
        cand[:, -1] = torch.where(inside, cand[:, -1], y)
        pos = torch.where(inside, pos, k - 1)
        counts = torch.ones_like(inside)
    else:
        counts = inside
    unary = scaled_logits(cfg, _CandidateLogits.apply(h, t.head_weight.detach(), cand))  # (M, K)
    pair = (sel.context(h, prev)[:, None, :] * sel.successor_codebook[cand]).sum(-1)  # (M, K)
    scores = unary.float() + pair.float()
    ce = F.cross_entropy(scores, pos, reduction="none")  # (M,)
    grid = torch.zeros(t.labels.shape, dtype=ce.dtype, device=ce.device)
    counted = torch.zeros_like(live)
    gold = torch.zeros_like(live)
    grid[live], counted[live], gold[live] = ce, counts, inside
    return grid, counted, gold, scores


def selector_loss(t: TrainingTerms, options: Any, weights_of: Any) -> Tensor:
    """α_sel(step) · Σ w·CE / N (module docstring) under the training options (`DFlash2TrainSettings`);
    `weights_of(ce, counted)` → (N, bs) slot weights."""
    ce, counted, _, _ = selector_terms(t, options.selector_rule)
    w = weights_of(ce.detach(), counted).to(ce.dtype) if options.selector_decay else counted.to(ce.dtype)  # (N, bs)
    total = (w * counted * ce).sum() / t.normalizer
    return selector_weight_at(options, t.step) * total


__all__ = ["selector_loss", "selector_terms", "selector_weight_at"]
