"""Domino's training objective (Model-Optimizer's and SpecForge's): CE of the corrected logits, mixed with CE of the
backbone's own logits by a weight that decays over training.

    loss = (1 − λ)·Σ w_k·CE(z_k, y_k) / N  +  λ·Σ w_k·CE(h_k·Wᵀ, y_k) / N
    λ(step) = lambda_base_start · (1 − min(step / ⌊total · lambda_base_decay_ratio⌋, 1)),  clamped to [0, 1]

over the live slots: slot k of the block at a has label y_k = the token at a + k + 1, its previous tokens are the
data's (teacher forcing: t_j = the token at a + j), w_k = exp(−k/γ) and N the step's normaliser (Σ w over the
step's live slots). The curriculum first trains the parallel backbone, then the correction. Rows are processed in
chunks under activation checkpointing, so no (rows, V') logits outlive their chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflashkit.drafter.heads.domino_net import prefix_states, token_embeddings

_CHUNK_LOGITS = 1 << 25  # rows × vocabulary per chunk: a few (rows, V') float32 tensors live at once


def lambda_base_at(options: Any, step: int, total_steps: int, progress: float | None = None) -> float:
    """λ at `step` (0-based) of a run of `total_steps` (the references' linear decay) under the training options
    (`DominoTrainSettings`); a time-based run gives the fraction of its schedule spent as `progress` instead (its step
    count is not known ahead)."""
    ratio = options.lambda_base_decay_ratio
    if progress is not None:
        done = min(progress / ratio, 1.0) if ratio > 0 else 1.0
    else:
        done = min(step / max(1, int(total_steps * ratio)), 1.0)
    return max(0.0, min(1.0, options.lambda_base_start * (1.0 - done)))


@dataclass
class DominoTerms:
    """One step's sums over its live slots: Σ w·CE of the corrected and of the base logits (differentiable), the
    corrected argmax's hits and the live slots per block slot (bs,), long."""

    final: Tensor
    base: Tensor
    correct: Tensor
    counted: Tensor


def _chunk_sums(
    h: Tensor, g: Tensor, weight: Tensor, labels: Tensor, w: Tensor, fixed: Tensor, proj: Any
) -> tuple[Tensor, Tensor]:
    """h (m, H), g (m, G), weight (V', H), labels (m,), w (m,), fixed (m,) bool (slot ≥ P), `proj` the correction
    (`embed_proj`) → ([Σ w·CE(final), Σ w·CE(base)] (2,) float32, the corrected argmax (m,))."""
    base = (h.to(weight.dtype) @ weight.t()).float()  # (m, V'): in the LM head's dtype, no copy of it
    fix = proj(torch.cat([h, g.to(h.dtype)], dim=-1)).float()  # (m, V')
    final = base + fix * fixed[:, None]
    ce_final = F.cross_entropy(final, labels, reduction="none")  # (m,)
    ce_base = F.cross_entropy(base, labels, reduction="none")
    return torch.stack([(w * ce_final).sum(), (w * ce_base).sum()]), final.detach().argmax(-1)


def domino_terms(
    drafter: Any, hidden: Tensor, head_weight: Tensor, labels: Tensor, prev_tokens: Tensor, weights: Tensor,
    embed_weight: Tensor,
) -> DominoTerms:  # fmt: skip
    """hidden (N, bs, H) final-normed block states, head_weight (V', H) the LM-head rows (frozen), labels (N, bs) draft
    ids (−100: none), prev_tokens (N, bs) target ids (t_k: the token before slot k's label), weights (bs,) → the sums
    of the module docstring (unnormalised)."""
    n, bs, _ = hidden.shape
    p = drafter.config.head_settings.pure_draft_prefix_len
    live = (labels >= 0) & (weights > 0).to(labels.device)[None]  # (N, bs)
    embeds = token_embeddings(drafter, prev_tokens, embed_weight)  # (N, bs, H)
    states = prefix_states(drafter, embeds)  # (N, bs, G): the GRU over whole blocks
    rows = live.reshape(-1).nonzero().squeeze(1)  # (M,)
    slot = rows % bs
    h, g = hidden.reshape(n * bs, -1)[rows], states.reshape(n * bs, -1)[rows]  # (M, H), (M, G)
    y = labels.reshape(-1)[rows]
    w = weights.to(hidden.device, torch.float32)[slot]  # (M,)
    fixed = slot >= p
    step = max(1, _CHUNK_LOGITS // max(1, head_weight.shape[0]))
    # zero, yet tied to every trainable input: a micro-batch without a live slot still back-propagates (and its
    # gradient reduction still runs under DDP)
    tied = (
        hidden.float().sum() * 0
        + sum(p.float().sum() for p in (*drafter.prefix_gru.parameters(), *drafter.embed_proj.parameters())) * 0
    )
    total = hidden.new_zeros(2, dtype=torch.float32) + tied
    correct = torch.zeros(bs, dtype=torch.long, device=hidden.device)
    weight = head_weight.detach()
    for r0 in range(0, rows.numel(), step):
        part = slice(r0, r0 + step)
        args = (h[part], g[part], weight, y[part], w[part], fixed[part], drafter.embed_proj)
        sums, preds = checkpoint(_chunk_sums, *args, use_reentrant=False)
        total = total + sums
        correct.index_add_(0, slot[part], (preds == y[part]).long())
    counted = live.sum(0)  # (bs,)
    return DominoTerms(final=total[0], base=total[1], correct=correct, counted=counted)


__all__ = ["DominoTerms", "domino_terms", "lambda_base_at"]
