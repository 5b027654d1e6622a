"""DFlash block losses: position-weighted cross-entropy (or KL to the target) computed in row chunks.

Block slot k (0..bs−1) predicts the token at anchor + k ("same-position" labels); slot 0 holds the clean anchor
token and has weight 0. The loss is

    loss = Σ_{valid slots} w_k · ℓ_slot / Σ_{valid slots} w_k          (or / `normalizer` when given)

with ℓ = cross-entropy against the label (kind="ce"), a divergence from the target's own final-layer distribution
(kind="kl": KL(p_target ‖ p_draft); "tv", "nla", "lk_hybrid": the acceptance-rate losses, see DISTRIBUTION_KINDS),
or (kind="topk") a KL to the target's stored top-k distribution mixed with the hard-label CE:

    ℓ = (1 − α)·KL(q_k ‖ p_draft) + α·CE(label),    α = `ce_weight`,
    q_k = the k stored entries renormalised over themselves: q_j = exp(lp_j) / Σ_i exp(lp_i) over the kept
          entries, lp = the stored log-probs (what most distillation code does; the probability outside the top k
          is dropped, not kept as a (k+1)-th "rest" bucket).

Entries with id −1 or log-prob −inf are dropped before renormalising (e.g. tokens outside a reduced draft
vocabulary); a slot left with no entry falls back to the hard label (α = 1 for that slot). The gradient with
respect to the logits is softmax − q_mix, q_mix = (1 − α)·q_k + α·onehot(label). A slot is valid when its label
is not −100.

Position weights: the fixed exponential decay (`decay_weights`, the original DFlash recipe) or D-PACE
(`dpace_weights`, arXiv 2605.18810; CE only): per block, from the drafter's own detached confidence
q_j = exp(−CE_j), w_j = Σ_{k≥j} m_k·Π_{i≤k} ((1 − α)·q_i + α) — the slots the drafter is likely to reach weigh
most. D-PACE's loss is Σ m_j·w_j·CE_j / N with N = Σ m_j, the number of valid draft slots (see `block_loss`).

Memory: the [N·bs, V] logits never exist at once. `block_loss` runs a custom autograd function that, chunk by
chunk of rows, computes the logits, the loss, the metrics and — when gradients are needed — the gradients with
respect to the hidden states and the LM head (softmax − target, scaled by the slot weight), then drops the
chunk's logits. Backward only scales those stored gradients, so gradients equal the unchunked computation.
The top-k target stays sparse — (ids, probs) of shape (M, k) — and is scattered into each chunk's gradient, so no
(M, V) target ever exists.

Draft vocabulary: `lm_head_weight` may be the reduced draft head; the caller then passes labels as draft ids,
with −100 where the target token is outside the draft vocabulary (and target logits restricted to it for KL;
top-k ids as draft ids, −1 outside it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# Block size → γ measured by the DFlash authors; other sizes interpolate (see `default_gamma`).
_GAMMA_POINTS = ((8, 4.0), (10, 5.0), (16, 7.0))
# Default chunk budget: at most this many logits (rows·bs·V, float32) materialised at once (256 MiB).
CHUNK_LOGITS = 1 << 26

TargetLogits = Tensor | Callable[[int, int], Tensor]
# Objectives against the target's full distribution p at each slot (q: the drafter's), per slot:
#   kl         KL(p ‖ q)
#   tv         1 − α = ½‖p − q‖₁,  α = Σ_v min(p_v, q_v): the acceptance rate of speculative sampling
#   nla        −log α (floored at NLA_EPS): TV's target with a gradient 1/α larger while α is small
#   lk_hybrid  λ·KL(p ‖ q) + (1 − λ)·TV,  λ = exp(−η·α) with α not differentiated (η = `lk_eta`) (speculators)
#   lk_lambda  λ·KL(p ‖ q) + (1 − λ)·TV with ONE λ per batch: λ = s·exp(−d·ᾱ), ᾱ the slot-weighted mean acceptance
#              of the batch's valid slots, not differentiated (s, d = `lk_kl_scale`, `lk_kl_decay`) (SpecForge's
#              lk_loss_type "lambda"; its "alpha", −mean log α, is nla)
# (the total variation, negative log-acceptance and hybrid LK losses of vllm-project/speculators)
DISTRIBUTION_KINDS = ("kl", "tv", "nla", "lk_hybrid", "lk_lambda")
NLA_EPS = 1e-5


def default_gamma(block_size: int) -> float:
    """γ for the decay weights: 7 for bs 16, 5 for 10, 4 for 8; other sizes piecewise-linear through those
    points, extrapolated along the nearest segment (slope 1/2 below 10, 1/3 above), never below 0.5.
    E.g. bs 4 → 2, bs 2 → 1, bs 12 → 5.67, bs 32 → 12.33."""
    pts = _GAMMA_POINTS
    if block_size <= pts[1][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    else:
        (x0, y0), (x1, y1) = pts[1], pts[2]
    return max(0.5, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def decay_weights(block_size: int, gamma: float | None = None) -> Tensor:
    """(bs,) float32: w_0 = 0, w_k = exp(−(k−1)/γ) for k ≥ 1; γ from `default_gamma` when None."""
    if block_size < 2:
        raise ValueError(f"block_size must be ≥ 2 for a DFlash loss (slot 0 is the anchor), got {block_size}")
    g = default_gamma(block_size) if gamma is None else float(gamma)
    if g <= 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / g)
    w[0] = 0.0
    return w


def draft_slot_weights(block_size: int) -> Tensor:
    """(bs,) float32: 0 for slot 0 (the given anchor), 1 for every draft slot — D-PACE's base weights (m_j)."""
    if block_size < 2:
        raise ValueError(f"block_size must be ≥ 2 for a DFlash loss (slot 0 is the anchor), got {block_size}")
    w = torch.ones(block_size, dtype=torch.float32)
    w[0] = 0.0
    return w


def dpace_weights(ce: Tensor, valid: Tensor, alpha: float = 0.5) -> Tensor:
    """D-PACE position weights per block (detached): ce (N, bs) per-slot cross-entropy, valid (N, bs) bool (m_j;
    slot 0 — the anchor — is never valid) → w (N, bs), 0 where invalid:

        q_j = exp(−CE_j),  q̃_j = (1 − α)·q_j + α where m_j else 1,  C_j = Π_{i≤j} q̃_i,  w_j = Σ_{k≥j} m_k·C_k.

    w_j is the expected number of accepted drafts that slot j's correctness contributes to, as the drafter itself
    estimates it: a slot after an unlikely one weighs little. α floors q̃ so early training (q ≈ 0 everywhere)
    still reaches later slots."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in [0, 1], got {alpha}")
    if ce.shape != valid.shape:
        raise ValueError(f"ce {tuple(ce.shape)} and valid {tuple(valid.shape)} must have the same shape")
    m = valid.to(ce.dtype)  # (N, bs)
    q = torch.exp(-ce.detach())
    q_tilde = torch.where(valid, (1 - alpha) * q + alpha, 1.0)  # (N, bs)
    c = torch.cumprod(q_tilde, dim=-1)  # C_j
    tail = torch.flip(torch.cumsum(torch.flip(m * c, [-1]), dim=-1), [-1])  # Σ_{k≥j} m_k C_k
    return tail * m


def estimated_tau(accuracy: Tensor | Sequence[float]) -> float:
    """Expected accepted length from per-slot accuracy (bs,): 1 + Σ_{k≥1} Π_{j=1..k} acc_j (slot 0 ignored)."""
    acc = torch.as_tensor(accuracy, dtype=torch.float64).flatten()
    return float(1.0 + torch.cumprod(acc[1:], dim=0).sum()) if acc.numel() > 1 else 1.0


@dataclass
class LossOutput:
    """Result of `block_loss`. Per-slot tensors are (bs,) and cover valid slots only."""

    loss: Tensor  # scalar, differentiable
    accuracy: Tensor  # (bs,) float32: argmax == label among valid slots (0 where no valid slot; slot 0,
    # the given anchor, is 1 whenever its weight is 0: the head does not run there)
    valid_counts: Tensor  # (bs,) long
    correct_counts: Tensor  # (bs,) long
    weight_sum: Tensor  # scalar: Σ w_k over valid slots (the default normaliser)

    @property
    def tau(self) -> float:
        return estimated_tau(self.accuracy)


class _ChunkedLinearLoss(torch.autograd.Function):
    """Σ_i row_w[i] · ℓ_i over flat slots, logits = h @ Wᵀ computed chunk by chunk; also returns argmax ids.

    With `reweight` (D-PACE), row_w only marks the live rows (≠ 0) and the weights come from the per-row losses:
    w = reweight(ℓ) (detached), total = Σ w_i ℓ_i. The gradient w.r.t. the hidden states is then taken unweighted in
    the same pass and scaled by w afterwards (exact, since w is a constant of the backward); a trainable head
    (its gradient sums over rows) needs the weights first, so it gets a loss-only pass before the gradient pass."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        row_w: Tensor,  # type: ignore[override]
        target: TargetLogits | None,
        bs: int,
        chunk_rows: int,
        need_gh: bool,
        need_gw: bool,
        soft: tuple[Tensor, Tensor] | None = None,
        alpha: float = 0.0,
        reweight: Callable[[Tensor], Tensor] | None = None,
        divergence: tuple[str, float] = ("kl", 0.0),
        extra: Tensor | None = None,
        need_ge: bool = False,
    ):
        # hidden: (M, H) with M = N·bs (H + r with `extra`); weight: (V, H); labels, row_w: (M,)
        # soft: sparse target (ids (M, k) long ≥ 0, probs (M, k); rows sum to 1, or to 0: hard label only)
        # extra: (V, r) rows appended to weight's columns (need_ge: form their gradient)
        run = dict(hidden=hidden, weight=weight, labels=labels, target=target, bs=bs, chunk_rows=chunk_rows)
        run.update(soft=soft, alpha=alpha, divergence=divergence, extra=extra)
        if reweight is None:
            total, _, preds, gh, gw, ge = _chunked_pass(
                row_w=row_w, need_gh=need_gh, need_gw=need_gw, need_ge=need_ge, **run
            )
        elif need_gw or need_ge:
            _, per, _, _, _, _ = _chunked_pass(row_w=row_w, need_gh=False, need_gw=False, need_ge=False, **run)
            w = reweight(per)  # (M,)
            total, _, preds, gh, gw, ge = _chunked_pass(
                row_w=w, need_gh=need_gh, need_gw=need_gw, need_ge=need_ge, **run
            )
        else:
            live = (row_w != 0).to(row_w.dtype)
            _, per, preds, gh, gw, ge = _chunked_pass(row_w=live, need_gh=need_gh, need_gw=False, need_ge=False, **run)
            w = reweight(per).to(per.dtype)  # (M,)
            total = (per * w).sum()
            if gh is not None:
                gh.mul_(w[:, None].to(gh.dtype))
        ctx.save_for_backward(gh if need_gh else None, gw if need_gw else None, ge if need_ge else None)
        ctx.weight_dtype = weight.dtype
        ctx.extra_dtype = extra.dtype if extra is not None else None
        ctx.mark_non_differentiable(preds)
        return total, preds

    @staticmethod
    def backward(ctx, grad_total: Tensor, grad_preds: Tensor):  # type: ignore[override]
        gh, gw, ge = ctx.saved_tensors
        d_h = gh * grad_total.to(gh.dtype) if gh is not None else None
        d_w = (gw * grad_total).to(ctx.weight_dtype) if gw is not None else None
        d_e = (ge * grad_total).to(ctx.extra_dtype) if ge is not None else None
        return d_h, d_w, None, None, None, None, None, None, None, None, None, None, None, d_e, None


def _chunked_pass(
    *,
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    row_w: Tensor,
    target: TargetLogits | None,
    bs: int,
    chunk_rows: int,
    need_gh: bool,
    need_gw: bool,
    soft: tuple[Tensor, Tensor] | None,
    alpha: float,
    divergence: tuple[str, float] = ("kl", 0.0),
    extra: Tensor | None = None,
    need_ge: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """One pass over the rows in chunks → (Σ row_w·ℓ, per-row ℓ (M,) (0 where row_w is 0), argmax ids (M,),
    d/d hidden (M, H) or None, d/d weight (V, H) or None, d/d extra (V, r) or None), the gradients of Σ row_w·ℓ.
    With `extra` (V, r) the logits are hidden[:, :H]·weightᵀ + hidden[:, H:]·extraᵀ: the frozen weight's
    gradient is never formed, only the extra rows' (when they require one)."""
    m = hidden.shape[0]
    hw = weight.shape[1]
    acc = torch.promote_types(weight.dtype, torch.float32)  # float32 for bf16/fp16, else as given
    total = torch.zeros((), dtype=acc, device=hidden.device)
    per_rows = torch.zeros(m, dtype=acc, device=hidden.device)
    preds = torch.empty(m, dtype=torch.long, device=hidden.device)
    gh = torch.empty_like(hidden) if need_gh else None
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_gw else None
    ge = torch.zeros(extra.shape, dtype=acc, device=extra.device) if need_ge else None
    step = chunk_rows * bs
    for start in range(0, m, step):
        end = min(start + step, m)
        h = hidden[start:end]  # (m_c, H) (H + r with extra)
        z = F.linear(h[:, :hw], weight)  # (m_c, V), in the head's dtype (bf16 under autocast)
        if extra is not None:
            z = z.to(acc) + F.linear(h[:, hw:].to(extra.dtype), extra).to(acc)
        logp = torch.log_softmax(z, dim=-1, dtype=acc)  # (m_c, V) float32, cast inside the kernel
        # the accuracy's argmax: of z itself in float32; of log p (z − lse, the same order) for a bf16 z, whose own
        # argmax has no vectorised kernel on CPU
        preds[start:end] = (z if z.dtype == acc else logp).argmax(-1)
        w = row_w[start:end].to(acc)  # (m_c,)
        live = w != 0
        if soft is not None:
            lab = labels[start:end].clamp(min=0)  # (m_c,)
            ids = soft[0][start:end].to(z.device)  # (m_c, k)
            q = soft[1][start:end].to(z.device, acc)  # (m_c, k)
            a = torch.where(q.sum(-1) > 0, alpha, 1.0).to(acc)  # (m_c,) no kept entry → hard label
            lp = logp.gather(1, ids)  # (m_c, k)
            kl = torch.where(q > 0, q * (q.log() - lp), 0.0).sum(-1)
            nll = -logp.gather(1, lab[:, None]).squeeze(1)
            per = torch.where(live, (1 - a) * kl + a * nll, 0.0)
        elif target is None:
            lab = labels[start:end].clamp(min=0)  # (m_c,)
            nll = -logp.gather(1, lab[:, None]).squeeze(1)
            per = torch.where(live, nll, 0.0)
        else:
            t = target(start // bs, end // bs) if callable(target) else target[start:end]
            logq = torch.log_softmax(t.reshape(end - start, -1).detach().to(z.device, acc), dim=-1)
            q = logq.exp()  # (m_c, V) the target's distribution
            per, g_div = _divergence(divergence, q, logq, logp)
            per = torch.where(live, per, 0.0)
        per_rows[start:end] = per
        total += (per * w).sum()
        if need_gh or need_gw or need_ge:
            rows = torch.arange(end - start, device=logp.device)
            if soft is None and target is None and extra is None and weight.dtype != acc and not need_gw:
                # hard labels, a lower-precision head and only d/d hidden: softmax − onehot written straight in the
                # head's dtype — the values of computing it in float32 and casting, without the float32 copy
                g = torch.exp(logp, out=torch.empty_like(logp, dtype=weight.dtype))
                g[rows, lab] = (logp[rows, lab].exp() - 1.0).to(weight.dtype)
            elif soft is not None:  # g = softmax − q_mix, one chunk at a time
                g = logp.exp()
                g.scatter_add_(1, ids, -(1 - a)[:, None] * q)
                g[rows, lab] -= a
            elif target is None:  # softmax − onehot
                g = logp.exp()
                g[rows, lab] -= 1.0
            else:
                g = g_div
            # d(loss)/d(logits) = w ⊙ g row by row: the row weight scales the products' smaller sides (m_c × H
            # instead of m_c × V), and a row of weight 0 is zeroed (not multiplied: its g may hold inf·0)
            rw = torch.where(live, w, 0.0)[:, None]  # (m_c, 1)
            if need_gh:
                gh[start:end, :hw] = torch.where(live[:, None], (g.to(weight.dtype) @ weight).to(acc) * rw, 0.0)
            if need_gh and extra is not None:
                gh[start:end, hw:] = torch.where(live[:, None], (g.to(extra.dtype) @ extra).to(acc) * rw, 0.0)
            if need_gw or need_ge:  # a row of weight 0 may hold non-finite g: zero it on both sides
                g = torch.where(live[:, None], g, 0.0)
                hw_rows = torch.where(live[:, None], h.to(acc) * rw, 0.0)  # (m_c, H + r)
            if need_gw:
                gw += g.t() @ hw_rows[:, :hw]
            if need_ge:
                ge += g.t() @ hw_rows[:, hw:]
    return total, per_rows, preds, gh, gw, ge


def _divergence(divergence: tuple[str, float], p: Tensor, logp: Tensor, logq: Tensor) -> tuple[Tensor, Tensor]:
    """(per-row loss (m,), its gradient with respect to the draft logits (m, V)) of one objective of
    DISTRIBUTION_KINDS, from the target's p / log p and the drafter's log q (each (m, V))."""
    kind, eta = divergence
    q = logq.exp()  # (m, V)
    kl = torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)  # (m,)
    if kind == "kl":
        return kl, q - p
    overlap = torch.minimum(p, q).sum(-1)  # α (m,)
    below = (q < p).to(q.dtype)  # where min(p, q) is q: dα/dq = 1 there
    d_overlap = q * (below - (below * q).sum(-1, keepdim=True))  # dα/dz = q ⊙ (c − ⟨c, q⟩)  (m, V)
    tv = 1.0 - overlap
    if kind == "tv":
        return tv, -d_overlap
    if kind == "nla":
        floor = overlap.clamp_min(NLA_EPS)
        return -floor.log(), torch.where((overlap > NLA_EPS)[:, None], -d_overlap / floor[:, None], 0.0)
    # (m, 1), α not differentiated; lk_lambda: one λ for the batch, computed before this pass (`block_loss`)
    lam = (torch.full_like(overlap, eta) if kind == "lk_lambda" else torch.exp(-eta * overlap))[:, None]
    return lam[:, 0] * kl + (1 - lam[:, 0]) * tv, lam * (q - p) - (1 - lam) * d_overlap


def _batch_lambda(args: tuple, scale: float, decay: float, extra: Tensor | None = None) -> float:
    """SpecForge's λ = scale·exp(−decay·ᾱ) for `lk_lambda`: ᾱ = Σ w·α / Σ w over the live rows of `args` (the
    arguments of `_ChunkedLinearLoss`), from a pass without gradients (one more LM-head product over the rows)."""
    hidden, weight, labels, row_w, target, bs, rows = args[:7]
    with torch.no_grad():
        run = dict(hidden=hidden.detach(), weight=weight.detach(), labels=labels, target=target, bs=bs)
        _, per, _, _, _, _ = _chunked_pass(
            **run, row_w=row_w, chunk_rows=rows, need_gh=False, need_gw=False, soft=None, alpha=0.0,
            divergence=("tv", 0.0), extra=extra.detach() if extra is not None else None,
        )  # fmt: skip
        w = row_w.to(per.dtype)
        mean_alpha = 1.0 - float((w * per).sum() / w.sum().clamp_min(torch.finfo(per.dtype).tiny))
    return float(scale) * math.exp(-float(decay) * mean_alpha)


def sparse_topk_target(ids: Tensor, logprobs: Tensor, shape: torch.Size, vocab: int) -> tuple[Tensor, Tensor]:
    """(ids (…, k), log-probs (…, k)) → (ids (M, k) long ≥ 0, probs (M, k) ≥ float32): each slot's kept entries
    (id ≥ 0 and log-prob > −inf) renormalised to sum to 1; dropped entries get id 0 and prob 0, and a slot with
    no kept entry sums to 0 (the loss then uses its hard label)."""
    k = ids.shape[-1]
    if ids.shape != logprobs.shape or ids.shape[:-1] != shape:
        raise ValueError(
            f"topk_ids {tuple(ids.shape)} and topk_logprobs {tuple(logprobs.shape)} must both be {(*tuple(shape), k)}"
        )
    ids = ids.reshape(-1, k).long()  # (M, k)
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(
            f"topk_ids hold id {int(ids.max())} ≥ the head's vocabulary {vocab}; map them to draft "
            f"ids (−1 outside the draft vocabulary) first"
        )
    lp = logprobs.reshape(-1, k).to(torch.promote_types(logprobs.dtype, torch.float32))
    lp = torch.where(ids >= 0, lp, float("-inf"))  # dropped entries
    top = lp.amax(-1, keepdim=True)
    e = torch.where(lp > float("-inf"), torch.exp(lp - top.clamp_min(torch.finfo(lp.dtype).min)), 0.0)
    total = e.sum(-1, keepdim=True)
    probs = torch.where(total > 0, e / total.clamp_min(torch.finfo(lp.dtype).tiny), 0.0)  # (M, k)
    return ids.clamp(min=0), probs


def _check_objective(
    kind: str, target_logits: Any, topk_ids: Any, topk_logprobs: Any, ce_weight: float, position_weights: str
) -> None:
    """Raise ValueError when `block_loss`'s objective arguments do not go together."""
    if kind not in ("ce", "topk", *DISTRIBUTION_KINDS):
        raise ValueError(f"kind must be 'ce', 'topk' or one of {DISTRIBUTION_KINDS}, got {kind!r}")
    if (kind in DISTRIBUTION_KINDS) != (target_logits is not None):
        raise ValueError(f"target_logits is required for kind in {DISTRIBUTION_KINDS} and only allowed with them")
    if (kind == "topk") != (topk_ids is not None and topk_logprobs is not None) or (
        kind != "topk" and (topk_ids is not None or topk_logprobs is not None)
    ):
        raise ValueError("topk_ids and topk_logprobs are required for kind='topk' and only allowed with it")
    if not 0.0 <= ce_weight <= 1.0 or (ce_weight and kind != "topk"):
        raise ValueError(f"ce_weight must be in [0, 1] and is only used with kind='topk', got {ce_weight}")
    if position_weights not in ("decay", "dpace"):
        raise ValueError(f"position_weights must be 'decay' or 'dpace', got {position_weights!r}")
    if position_weights == "dpace" and kind != "ce":
        raise ValueError(
            f"position_weights='dpace' needs hard-label cross-entropy (kind='ce'), got kind={kind!r}: its weights "
            f"are built from exp(−CE), the drafter's probability of the label"
        )


def _cast_frozen(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """A frozen head in `dtype`, the same tensor from step to step while the head is unchanged (its version), kept
    on the head itself (so it lives as long as the head): a product's library keeps its own layout of a weight it has
    seen (oneDNN's reordered bf16 weights on CPU), which a fresh copy every step would pay again."""
    if weight.dtype == dtype:
        return weight
    key = (weight._version, dtype)
    hit = getattr(weight, "_dflashkit_cast", None)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, weight.detach().to(dtype))
        weight._dflashkit_cast = hit
    return hit[1]


def block_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    weights: Tensor | None = None,
    kind: str = "ce",
    target_logits: TargetLogits | None = None,
    chunk_size: int | None = None,
    normalizer: Tensor | float | None = None,
    topk_ids: Tensor | None = None,
    topk_logprobs: Tensor | None = None,
    ce_weight: float = 0.0,
    position_weights: str = "decay",
    dpace_alpha: float = 0.5,
    lk_eta: float = 3.0,
    lk_kl_scale: float = 1.0,
    lk_kl_decay: float = 1.0,
    extra_rows: Tensor | None = None,
) -> LossOutput:
    """Weighted block loss over drafter outputs.

    hidden: (N, bs, H) final-normed drafter states (any leading dims (..., bs, H) are flattened to N);
    lm_head_weight: (V, H) (the target's LM head, or the reduced draft head); labels: (N, bs) long, −100 invalid;
    weights: (bs,) slot weights, default `decay_weights(bs)`;
    kind: "ce" (labels), or one of DISTRIBUTION_KINDS against the target's distribution — "kl" (KL(target ‖ draft)),
        "tv", "nla", "lk_hybrid" (η = `lk_eta`), "lk_lambda" (`lk_kl_scale`, `lk_kl_decay`) — from
        `target_logits` (N, bs, V) or a callable
        `(row_start, row_end) -> (rows, bs, V)` over the flattened N rows (labels still mark validity/accuracy)
        or "topk" ((1 − ce_weight)·KL(renormalised top-k ‖ draft) + ce_weight·CE; `topk_ids` (N, bs, k) long in
        [0, V) or −1 (dropped) and `topk_logprobs` (N, bs, k), −inf where dropped; see the module docstring);
    chunk_size: rows (blocks) per chunk; default keeps a chunk's logits under 2^26 elements;
    normalizer: divide by this instead of the valid-slot weight sum (e.g. a global sum across ranks);
    position_weights: "decay" (the fixed `weights`) or "dpace" (kind="ce" only): each valid slot's CE is weighted by
        `dpace_weights` of its block (α = `dpace_alpha`), computed from this very forward and detached; `weights`
        then only marks the draft slots (default `draft_slot_weights`: all but slot 0), so the default normaliser
        N is the number of valid draft slots Σ m_j — known from the labels before the forward, hence one global
        value across micro-batches and ranks, and a loss scale that does not move with the drafter's confidence.
    extra_rows: (V, r) trainable rows appended to a frozen head's columns — logits hidden[..., :H]·Wᵀ +
        hidden[..., H:]·extra_rowsᵀ, `hidden` then (N, bs, H + r) — whose gradient is formed without W's.
    """
    _check_objective(kind, target_logits, topk_ids, topk_logprobs, ce_weight, position_weights)
    bs, h_dim = hidden.shape[-2], hidden.shape[-1]
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}")
    r = extra_rows.shape[-1] if extra_rows is not None else 0
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != h_dim - r:
        raise ValueError(f"lm_head_weight must be (V, {h_dim - r}), got {tuple(lm_head_weight.shape)}")
    vocab = lm_head_weight.shape[0]
    if extra_rows is not None and (extra_rows.dim() != 2 or extra_rows.shape[0] != vocab):
        raise ValueError(f"extra_rows must be ({vocab}, r), got {tuple(extra_rows.shape)}")
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and not lm_head_weight.requires_grad:
        # a frozen head under autocast: cast once, not in every chunk's two products
        lm_head_weight = _cast_frozen(lm_head_weight, torch.get_autocast_dtype(dev))
    flat_h = hidden.reshape(-1, h_dim).to(lm_head_weight.dtype)  # (M, H), M = N·bs
    flat_lab = labels.reshape(-1).long()  # (M,)
    n = flat_lab.numel() // bs if bs else 0
    acc = torch.promote_types(lm_head_weight.dtype, torch.float32)
    dpace = position_weights == "dpace"
    base = (draft_slot_weights(bs) if dpace else decay_weights(bs)) if weights is None else weights
    w = base.to(device=hidden.device, dtype=acc)
    if w.shape != (bs,):
        raise ValueError(f"weights must be ({bs},), got {tuple(w.shape)}")
    valid = (flat_lab != -100).view(n, bs)  # (N, bs)
    slot_w = w[None] * valid  # (N, bs)
    weight_sum = slot_w.sum()
    norm = weight_sum if normalizer is None else torch.as_tensor(normalizer, dtype=acc, device=hidden.device)
    row_w = (slot_w / norm.clamp_min(torch.finfo(acc).tiny)).reshape(-1)  # (M,)
    target = target_logits
    if isinstance(target, Tensor):
        if target.shape[:-1] != labels.shape or target.shape[-1] != vocab:
            raise ValueError(f"target_logits must be {(*tuple(labels.shape), vocab)}, got {tuple(target.shape)}")
        target = target.reshape(-1, vocab)
    soft = None
    if kind == "topk":
        soft = sparse_topk_target(topk_ids, topk_logprobs, labels.shape, vocab)
    rows = chunk_size if chunk_size is not None else max(1, CHUNK_LOGITS // max(1, bs * vocab))
    if rows < 1:
        raise ValueError(f"chunk_size must be ≥ 1, got {chunk_size}")
    grad_on = torch.is_grad_enabled()
    live_rows, all_labels = None, flat_lab
    if not callable(target) and flat_lab.numel():
        # Rows with weight 0 (slot 0 — the given anchor — and slots without a label) add nothing to the loss or
        # the gradients: the LM head runs only over the rows that carry one (a quarter fewer at block size 4).
        live_rows = (row_w != 0).nonzero().squeeze(1)  # (M_live,)
        flat_h, flat_lab, row_w = flat_h.index_select(0, live_rows), flat_lab[live_rows], row_w[live_rows]
        target = target[live_rows] if target is not None else None
        soft = (soft[0][live_rows], soft[1][live_rows]) if soft is not None else None
    args = (
        flat_h,
        lm_head_weight,
        flat_lab,
        row_w,
        target,
        bs,
        rows,
        grad_on and flat_h.requires_grad,
        grad_on and lm_head_weight.requires_grad,
    )
    tail = (extra_rows, grad_on and extra_rows is not None and extra_rows.requires_grad)  # the Function's last two
    reweight = None
    if dpace:
        scale = norm.clamp_min(torch.finfo(acc).tiny)

        def reweight(per: Tensor) -> Tensor:  # per-row CE of the live rows (M_live,) → their D-PACE weights / N
            ce = torch.zeros(n * bs, dtype=per.dtype, device=per.device)
            ce = ce.index_copy(0, live_rows, per) if live_rows is not None else per
            dw = dpace_weights(ce.view(n, bs), slot_w > 0, dpace_alpha).reshape(-1)  # (M,)
            dw = dw[live_rows] if live_rows is not None else dw
            return dw / scale.to(per.dtype)

    if soft is not None:
        loss, preds = _ChunkedLinearLoss.apply(*args, soft, float(ce_weight), None, ("kl", 0.0), *tail)
    elif reweight is not None:
        loss, preds = _ChunkedLinearLoss.apply(*args, None, 0.0, reweight, ("kl", 0.0), *tail)
    elif kind in DISTRIBUTION_KINDS:  # lk_lambda: its one λ for the batch, else η
        param = _batch_lambda(args, lk_kl_scale, lk_kl_decay, extra_rows) if kind == "lk_lambda" else float(lk_eta)
        loss, preds = _ChunkedLinearLoss.apply(*args, None, 0.0, None, (kind, param), *tail)
    else:
        loss, preds = _ChunkedLinearLoss.apply(*args, None, 0.0, None, ("kl", 0.0), *tail)
    if live_rows is not None:  # rows the head did not run over: slot 0 is the given anchor (counted as right),
        full = torch.full((n, bs), -1, dtype=torch.long, device=preds.device)  # the others predict nothing
        full[:, 0] = all_labels.view(n, bs)[:, 0]
        preds = full.view(-1).index_copy_(0, live_rows, preds)
    with torch.no_grad():
        correct = ((preds.view(n, bs) == all_labels.view(n, bs)) & valid).sum(0)  # (bs,)
        counts = valid.sum(0)  # (bs,)
        acc = correct.float() / counts.clamp_min(1).float()
    return LossOutput(
        loss=loss, accuracy=acc, valid_counts=counts, correct_counts=correct, weight_sum=weight_sum.detach()
    )
