"""The DSpark objective (DeepSpec's defaults), computed in row chunks so no (rows, V) tensor lives at once:
`DSparkHead.objective` (`dspark_objective`) in place of the backbone's, from the step's `TrainingTerms`.

Block slot k (0..γ−1) of the block at anchor a drafts the token at a + k + 1; its logits are the backbone's plus the
Markov bias of its previous token (teacher-forced: the anchor's token for slot 0, the label of slot k − 1 after):

    z_k   = h_k·Wᵀ + W2·W1[prev_k]                          (W: the target's LM-head rows of the draft vocabulary)
    CE_k  = −log softmax(z_k)[label_k]
    L1_k  = ‖softmax(z_k) − p_target,k‖₁                   (over the target's whole vocabulary; a reduced draft
                                                             vocabulary has probability 0 outside it)
    y_k   = clamp(1 − ½·L1_k, 0, 1)   (detached)           the chance a sampled draft is accepted at slot k
    BCE_k = BCE(sigmoid(conf_k), y_k),  conf_k = w·[h_k ; W1[prev_k]] + b
    loss  = Σ_k w_k·(0.1·CE_k + 0.9·L1_k + 1.0·BCE_k) / Σ_k w_k,     w_k = exp(−k/4) over valid slots

p_target,k is the target's next-token distribution at index a + k (its logits from the final layer's hidden state
there). A slot is valid while its label and every earlier one are (a contiguous supervised prefix: teacher
forcing needs the previous label). CE is skipped (not the other terms) where the label lies outside a reduced
draft vocabulary. Gradients of the CE and L1 terms are formed chunk by chunk in the forward (softmax − one-hot;
p ⊙ (s − ⟨p, s⟩) with s = sign(p − p_target)) and only scaled in the backward; the confidence term is ordinary
autograd over (rows, H + r). The LM head is frozen; W1, W2, the confidence head and the backbone train.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflashkit.drafter.heads.base import HeadObjective, TrainingTerms

DSPARK_DECAY = 4.0  # DeepSpec's loss_decay_gamma: w_k = exp(−k/4)
_CHUNK_LOGITS = 1 << 25  # rows × vocabulary per chunk (two float32 (rows, V) tensors live: 256 MiB)


@dataclass(frozen=True)
class DSparkLossWeights:
    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0


@dataclass(frozen=True)
class DSparkLossSpec:
    """How `dspark_loss` weighs one batch: its terms' weights; the slot weights (γ,) (None: `dspark_slot_weights`);
    the normaliser (None: Σ w over the valid slots, or their number under D-PACE); `dpace`: D-PACE's rule (per-slot
    CE (N, γ), valid (N, γ) → the CE term's slot weights (N, γ)) in place of the slot weights for the CE term (the
    L1 and confidence terms keep them); `chunk_rows`: rows per chunk (None: by the vocabulary's width)."""

    loss_weights: DSparkLossWeights = DSparkLossWeights()
    weights: Tensor | None = None
    normalizer: Tensor | float | None = None
    dpace: Callable[[Tensor, Tensor], Tensor] | None = None
    chunk_rows: int | None = None


@dataclass
class _LiveRows:
    """The live rows' labels (M,) (draft ids, −100: no CE) and each row's CE and L1 weights (M,)."""

    labels: Tensor
    ce_w: Tensor
    l1_w: Tensor


@dataclass
class _TargetSide:
    """Rows [r0, r1) → the target's logits (see `_target_probs`); the draft ids' target ids (V',) (None: the whole
    vocabulary); rows per chunk."""

    logits_of: Callable[[int, int], Tensor | tuple[Tensor, ...]]
    d2t: Tensor | None
    chunk_rows: int


def dspark_slot_weights(num_slots: int, gamma: float | None = None) -> Tensor:
    """(γ,) float32: exp(−k/gamma) for k = 0..γ−1 (gamma default 4, DeepSpec's)."""
    g = DSPARK_DECAY if gamma is None else float(gamma)
    if num_slots < 1 or g <= 0:
        raise ValueError(f"need ≥ 1 slot and gamma > 0, got {num_slots} slots, gamma {gamma}")
    return torch.exp(-torch.arange(num_slots, dtype=torch.float32) / g)


class _ChunkedDSparkTerms(torch.autograd.Function):
    """Σ_i (a_i·CE_i + b_i·L1_i) over live rows, z = h·Wᵀ + e·W2ᵀ chunk by chunk; also returns L1 and argmax."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,  # (M, H)
        emb: Tensor,  # (M, r) = W1[prev]
        w2: Tensor,  # (V', r)
        weight: Tensor,  # (V', H) frozen
        rows_in: _LiveRows,
        target: _TargetSide,
    ):  # type: ignore[override]
        labels, ce_row_w, l1_row_w = rows_in.labels, rows_in.ce_w, rows_in.l1_w
        target_logits, d2t, chunk_rows = target.logits_of, target.d2t, target.chunk_rows
        m = hidden.shape[0]
        acc = torch.float32 if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.dtype
        total = torch.zeros((), dtype=acc, device=hidden.device)
        l1_rows = torch.zeros(m, dtype=acc, device=hidden.device)
        preds = torch.empty(m, dtype=torch.long, device=hidden.device)
        gh, ge = torch.empty_like(hidden), torch.empty_like(emb)
        gw2 = torch.zeros(w2.shape, dtype=acc, device=w2.device)
        for s in range(0, m, chunk_rows):
            e_ = min(s + chunk_rows, m)
            h, em = hidden[s:e_].to(acc), emb[s:e_].to(acc)
            z = h @ weight.to(acc).t() + em @ w2.to(acc).t()  # (m_c, V')
            logp = torch.log_softmax(z, dim=-1)
            p = logp.exp()
            pt, outside = _target_probs(target_logits(s, e_), d2t, z.device, acc)  # (m_c, V'), (m_c,)
            diff = p - pt
            l1 = torch.linalg.vector_norm(diff, ord=1, dim=-1) + outside  # (m_c,)
            lab = labels[s:e_]
            has = lab >= 0
            rows = torch.arange(e_ - s, device=z.device)
            ce = torch.where(has, -logp[rows, lab.clamp(min=0)], 0.0)
            a, b = ce_row_w[s:e_].to(acc), l1_row_w[s:e_].to(acc)  # (m_c,)
            total += (a * ce + b * l1).sum()
            l1_rows[s:e_] = l1
            preds[s:e_] = z.argmax(-1)
            # d/dz of a·CE + b·L1 = b·p⊙(s − ⟨p, s⟩) + a·(p − onehot), s = sign(p − p_target), in place
            ps = diff.sign_().mul_(p)  # p ⊙ s
            coef = a * has.to(acc) - b * ps.sum(-1)  # (m_c,)
            g = ps.mul_(b[:, None]).addcmul_(p, coef[:, None])
            g[rows[has], lab[has]] -= a[has]
            gh[s:e_] = (g @ weight.to(acc)).to(hidden.dtype)
            ge[s:e_] = (g @ w2.to(acc)).to(emb.dtype)
            gw2 += g.t() @ em
        ctx.save_for_backward(gh, ge, gw2)
        ctx.w2_dtype = w2.dtype
        ctx.mark_non_differentiable(l1_rows, preds)
        return total, l1_rows, preds

    @staticmethod
    def backward(ctx, grad_total: Tensor, _g_l1: Tensor, _g_preds: Tensor):  # type: ignore[override]
        gh, ge, gw2 = ctx.saved_tensors
        g = grad_total
        return gh * g.to(gh.dtype), ge * g.to(ge.dtype), (gw2 * g).to(ctx.w2_dtype), None, None, None


@torch.no_grad()
def _markov_ce(hidden: Tensor, emb: Tensor, w2: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int) -> Tensor:
    """(M,) CE of each row's Markov-corrected logits to its label (draft ids), +inf where the label lies outside a
    reduced draft vocabulary (probability 0): what D-PACE reads its confidences from, before the weighted pass."""
    acc = torch.float32 if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.dtype
    out = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk_rows):
        e_ = min(s + chunk_rows, hidden.shape[0])
        z = hidden[s:e_].to(acc) @ weight.to(acc).t() + emb[s:e_].to(acc) @ w2.to(acc).t()  # (m_c, V')
        lab = labels[s:e_]
        picked = z.gather(1, lab.clamp(min=0)[:, None])[:, 0]
        out[s:e_] = torch.where(lab >= 0, torch.logsumexp(z, dim=-1) - picked, torch.inf)
    return out


def _target_probs(
    source: Tensor | tuple[Tensor, ...], d2t: Tensor | None, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor | float]:
    """The target's probabilities of the draft vocabulary (m, V') and its mass outside it (m,) (0.0 without a
    reduced vocabulary). `source`: logits (m, V); or (logits of U distinct positions (U, V), index (m,) of each
    row's position) — slots of overlapping blocks share positions, so the softmax runs once per position; or
    (logits of the draft ids only (U, V'), the log-sum-exp over the whole vocabulary (U,), index (m,)) — then
    p = exp(z − lse) without any full-vocabulary product (`dflashkit.train.target_lse`)."""
    if isinstance(source, tuple) and len(source) == 3:
        z, lse, inverse = source
        pt = torch.exp(z.to(device, dtype) - lse.to(device, dtype)[:, None])  # (U, V')
        outside = (1 - pt.sum(-1)).clamp_min(0) if d2t is not None else None
    else:
        logits, inverse = source if isinstance(source, tuple) else (source, None)
        pt = torch.softmax(logits.to(device, dtype), dim=-1)  # (U, V)
        if d2t is not None:
            pt = pt.index_select(1, d2t)  # (U, V')
        outside = (1 - pt.sum(-1)).clamp_min(0) if d2t is not None else None  # target mass the draft cannot hold
    if inverse is not None:
        inverse = inverse.to(device)
        pt = pt.index_select(0, inverse)
        outside = outside.index_select(0, inverse) if outside is not None else None
    return pt, (outside if outside is not None else 0.0)


def dspark_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    drafter: torch.nn.Module,
    labels: Tensor,
    prev_tokens: Tensor,
    target_logits: Tensor | Callable[[Tensor], Any],
    spec: DSparkLossSpec = DSparkLossSpec(),
    draft_labels: Tensor | None = None,
) -> HeadObjective:
    """The DSpark loss of one batch of blocks (see the module docstring), weighed as `spec` says.

    hidden (N, γ, H) final-normed backbone states; lm_head_weight (V', H): the target's head rows of the draft
    vocabulary (frozen); drafter: holds `markov_head` (and `confidence_head` if it has one) and `to_target_ids`;
    labels (N, γ) target ids, −100 where invalid (the valid slots must form a prefix of each block); prev_tokens
    (N, γ) target ids teacher-forced into the Markov head; target_logits: the target's logits at each slot's
    index, (N, γ, V), or a callable `flat_rows (m,) → (m, V)` over the flattened N·γ slots (or → (logits of the
    U distinct positions among them (U, V), each row's index into them (m,)), or → (their draft-id logits (U, V'),
    log-sum-exp over V (U,), index (m,)), see `_target_probs`); draft_labels (N, γ): labels as draft ids (−100
    outside a reduced vocabulary), default = labels. Under D-PACE (`spec.dpace`) the CE term's slot weights are that
    rule's of each block's detached Markov-corrected CE, the L1 and confidence terms keep `spec.weights`, and the
    default normaliser is the number of valid slots — speculators' DSpark + D-PACE (its CE-only loss and confidence
    BCE) when the L1 weight is 0. Returns the loss with, per slot (γ,), the argmax hits and the valid slots, and the
    weight sum (the default normaliser).
    """
    n, g, h_dim = hidden.shape
    if labels.shape != (n, g) or prev_tokens.shape != (n, g):
        raise ValueError(f"labels {tuple(labels.shape)} and prev_tokens {tuple(prev_tokens.shape)} must be {(n, g)}")
    valid = labels != -100  # (N, γ)
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ValueError("DSpark labels must be valid on a prefix of each block (teacher forcing reads slot k − 1)")
    acc = torch.float32 if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.dtype
    w = (dspark_slot_weights(g) if spec.weights is None else spec.weights).to(hidden.device, acc)
    dpace = spec.dpace is not None
    slot_w = w[None] * valid  # (N, γ)
    weight_sum = valid.to(acc).sum() if dpace else slot_w.sum()  # D-PACE: N = the number of valid slots
    normalizer = spec.normalizer
    norm = weight_sum if normalizer is None else torch.as_tensor(normalizer, dtype=acc, device=hidden.device)
    row_w = (slot_w / norm.clamp_min(torch.finfo(acc).tiny)).reshape(-1)  # (M,)
    live = (valid.reshape(-1) & (row_w != 0)).nonzero().squeeze(1)  # (M_live,)
    flat_h = hidden.reshape(-1, h_dim).index_select(0, live)  # (M_live, H)
    dl = labels if draft_labels is None else draft_labels
    lab_live = dl.reshape(-1)[live]
    prev_live = prev_tokens.reshape(-1)[live]
    markov = drafter.markov_head
    emb = markov.prev_embeddings(prev_live)  # (M_live, r), differentiable through W1
    if callable(target_logits):
        rows_of = lambda r0, r1: target_logits(live[r0:r1])  # noqa: E731
    else:
        flat_t = target_logits.reshape(n * g, -1)
        rows_of = lambda r0, r1: flat_t[live[r0:r1]]  # noqa: E731
    vocab = lm_head_weight.shape[0]
    rows = spec.chunk_rows if spec.chunk_rows is not None else max(1, _CHUNK_LOGITS // max(1, vocab))
    d2t = drafter.draft_to_target.to(hidden.device) if getattr(drafter.config, "draft_vocab_size", None) else None
    lw = spec.loss_weights
    ce_row_w = lw.ce * row_w[live]  # (M_live,)
    # D-PACE weights from this very forward's CE (a no-grad pass first: they depend on later slots)
    if spec.dpace is not None:
        ce_all = torch.zeros(n * g, dtype=acc, device=hidden.device)
        ce_all[live] = _markov_ce(flat_h, emb, markov.markov_w2.weight, lm_head_weight, lab_live, rows)
        dw = spec.dpace(ce_all.view(n, g), valid).reshape(-1)  # (M,)
        ce_row_w = lw.ce * dw[live] / norm.clamp_min(torch.finfo(acc).tiny)
    total, l1, preds = _ChunkedDSparkTerms.apply(
        flat_h, emb, markov.markov_w2.weight, lm_head_weight.detach(),
        _LiveRows(lab_live, ce_row_w, lw.l1 * row_w[live]), _TargetSide(rows_of, d2t, rows),
    )  # fmt: skip
    conf_head = getattr(drafter, "confidence_head", None)
    if conf_head is not None and lw.confidence and live.numel():
        conf = conf_head(flat_h, emb).float()  # (M_live,) logits
        y = (1 - 0.5 * l1).clamp(0, 1).to(conf.dtype)  # detached: l1 is non-differentiable
        bce = F.binary_cross_entropy_with_logits(conf, y, reduction="none")
        total = total + lw.confidence * (row_w[live].to(bce.dtype) * bce).sum()
    with torch.no_grad():
        full = torch.full((n * g,), -1, dtype=torch.long, device=hidden.device)
        full[live] = preds
        correct = ((full.view(n, g) == dl) & valid & (dl >= 0)).sum(0)  # (γ,)
        counts = valid.sum(0)  # (γ,)
    return HeadObjective(loss=total, correct_counts=correct, valid_counts=counts, weight_sum=weight_sum.detach())


def dspark_objective(terms: TrainingTerms, options: Any) -> HeadObjective:
    """DSpark's objective of one training step: the step's labels (target ids for the valid prefix, draft ids for the
    CE), the target's distribution at each slot (`terms.target_logits`), the run's slot weights — D-PACE's rule
    (`terms.weights_of`) for the CE term under `position_weights: dpace`, where the L1 and confidence terms keep
    exp(−k/4) — and its terms' weights from its training options (`DSparkTrainSettings`)."""
    dpace = terms.train_cfg.position_weights == "dpace"
    spec = DSparkLossSpec(
        loss_weights=DSparkLossWeights(
            options.dspark_ce_weight, options.dspark_l1_weight, options.dspark_confidence_weight
        ),
        weights=None if dpace else terms.weights,
        normalizer=terms.normalizer,
        dpace=terms.weights_of if dpace else None,
    )
    labels = terms.target_labels if terms.target_labels is not None else terms.labels
    return dspark_loss(
        terms.hidden, terms.head_weight, terms.drafter, labels, terms.prev_tokens, terms.target_logits, spec,
        draft_labels=terms.labels,
    )  # fmt: skip


__all__ = [
    "DSPARK_DECAY",
    "DSparkLossSpec",
    "DSparkLossWeights",
    "dspark_loss",
    "dspark_objective",
    "dspark_slot_weights",
]
