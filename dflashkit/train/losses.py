"""DFlash block losses: position-weighted cross-entropy (or KL to the target) computed in row chunks.

Block slot k (0..bs−1) predicts the token at anchor + k ("same-position" labels); slot 0 holds the clean anchor
token and has weight 0. The loss is

    loss = Σ_{valid slots} w_k · ℓ_slot / Σ_{valid slots} w_k          (or / `LossSpec.normalizer` when given)

with ℓ = cross-entropy against the label (kind="ce"), a divergence from the target's own final-layer distribution
(kind="kl": KL(p_target ‖ p_draft); "tv", "nla", "lk_hybrid": the acceptance-rate losses, see DISTRIBUTION_KINDS),
or (kind="topk") a KL to the target's stored top-k distribution mixed with the hard-label CE:

    ℓ = (1 − α)·KL(q_k ‖ p_draft) + α·CE(label),    α = `LossSpec.ce_weight`,
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

The call is `block_loss(hidden, head, labels, spec, target)`: the objective's settings are one `LossSpec` (built
once from a TrainConfig by `LossSpec.from_config`), the batch's target side one `LossTarget`; each kind is one small
function of a chunk (`_ce`, `_topk_kl`, and `_kl`, `_tv`, `_nla`, `_lk` against the target's distribution).

Memory: the [N·bs, V] logits never exist at once. `block_loss` runs a custom autograd function that, chunk by
chunk of rows (`_chunked_pass`, the one loop over chunks), computes the logits, the loss, the metrics and — when
gradients are needed — the gradients with respect to the hidden states and the LM head (softmax − target, scaled by
the slot weight), then drops the chunk's logits. Backward only scales those stored gradients, so gradients equal the
unchunked computation. The top-k target stays sparse — (ids, probs) of shape (M, k) — and is scattered into each
chunk's gradient, so no (M, V) target ever exists.

Draft vocabulary: the head may be the reduced draft head; the caller then passes labels as draft ids, with −100
where the target token is outside the draft vocabulary (and target logits restricted to it for KL; top-k ids as
draft ids, −1 outside it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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


@dataclass(frozen=True, eq=False)
class LossSpec:
    """The objective's settings, fixed for a run (`from_config` reads them off a TrainConfig): which loss, its knobs,
    the slot weights and the normaliser. See the module docstring for the formulas."""

    kind: str = "ce"  # "ce", "topk" or one of DISTRIBUTION_KINDS
    weights: Tensor | None = None  # (bs,) slot weights; None: decay_weights(bs) (D-PACE: draft_slot_weights(bs))
    # divide by this instead of the valid-slot weight sum (e.g. a global sum across micro-batches and ranks)
    normalizer: Tensor | float | None = None
    chunk_size: int | None = None  # rows (blocks) per chunk; None keeps a chunk's logits under CHUNK_LOGITS
    ce_weight: float = 0.0  # topk: α, the hard label's share of (1 − α)·KL_topk + α·CE
    position_weights: str = "decay"  # "decay" (the fixed `weights`) or "dpace" (kind "ce" only)
    dpace_alpha: float = 0.5  # D-PACE's floor α in q̃ = (1 − α)·exp(−CE) + α
    lk_eta: float = 3.0  # lk_hybrid: η in λ = exp(−η·α)
    lk_kl_scale: float = 1.0  # lk_lambda: s in λ = s·exp(−d·ᾱ)
    lk_kl_decay: float = 1.0  # lk_lambda: d

    @classmethod
    def from_config(
        cls, cfg: Any, *, weights: Tensor | None = None, normalizer: Tensor | float | None = None
    ) -> LossSpec:
        """The objective a TrainConfig names, with the run's slot `weights` and the step's `normalizer`."""
        return cls(
            kind=cfg.loss,
            weights=weights,
            normalizer=normalizer,
            chunk_size=cfg.loss_chunk_size,
            ce_weight=cfg.topk_ce_weight if cfg.loss == "topk" else 0.0,
            position_weights=cfg.position_weights,
            dpace_alpha=cfg.dpace_alpha,
            lk_eta=cfg.lk_eta,
            lk_kl_scale=cfg.lk_kl_scale,
            lk_kl_decay=cfg.lk_kl_decay,
        )

    def with_kind(self, kind: str) -> LossSpec:
        """The same settings for another loss kind (the top-k mix's α belongs to "topk" alone)."""
        return dataclasses.replace(self, kind=kind, ce_weight=self.ce_weight if kind == "topk" else 0.0)

    def chunk_rows(self, bs: int, vocab: int) -> int:
        """Blocks per chunk: `chunk_size`, or as many as keep a chunk's logits under CHUNK_LOGITS."""
        rows = self.chunk_size if self.chunk_size is not None else max(1, CHUNK_LOGITS // max(1, bs * vocab))
        if rows < 1:
            raise ValueError(f"chunk_size must be ≥ 1, got {self.chunk_size}")
        return rows


@dataclass(frozen=True, eq=False)
class LossTarget:
    """A batch's target side beyond the labels: the target's logits (DISTRIBUTION_KINDS) or its stored top-k
    ("topk"), over the same (N, bs) slots as the labels."""

    # (N, bs, V), or a callable (row_start, row_end) -> (rows, bs, V) over the flattened N rows
    logits: TargetLogits | None = None
    topk_ids: Tensor | None = None  # (N, bs, k) long in [0, V), or −1 (dropped)
    topk_logprobs: Tensor | None = None  # (N, bs, k), −inf where dropped


@dataclass(frozen=True, eq=False)
class LMHead:
    """The rows the logits are taken against: `weight` (V, H) — the target's LM head or the reduced draft head — and
    optionally trainable `extra` rows (V, r) appended to a frozen weight's columns: logits hidden[..., :H]·weightᵀ +
    hidden[..., H:]·extraᵀ, whose gradient is formed without the weight's."""

    weight: Tensor
    extra: Tensor | None = None


class _Grads(NamedTuple):
    """Which gradients a pass forms: with respect to the hidden states, the head's weight, its extra rows."""

    hidden: bool
    weight: bool
    extra: bool


_NO_GRADS = _Grads(False, False, False)


@dataclass(frozen=True, eq=False)
class _Chunk:
    """One chunk of rows as a loss kind sees it."""

    start: int  # its rows [start, end) of the M flat rows
    end: int
    logp: Tensor  # (m_c, V) the drafter's log-probs in the accumulation dtype (float32 for a bf16 head)
    labels: Tensor  # (m_c,) long, −100 clamped to 0 (those rows are masked out by their weight 0)
    want_grad: bool  # form d ℓ/d logits
    # the head's dtype where it is lower than logp's and only d/d hidden is wanted (no extra rows): a kind may write
    # its gradient straight in it
    low_dtype: torch.dtype | None


# one chunk → (ℓ per row (m_c,), d ℓ/d logits (m_c, V), None when no gradient is wanted); rows of weight 0 are
# masked by the caller
SlotLoss = Callable[[_Chunk], tuple[Tensor, Tensor | None]]
# (target p, log p, drafter q, log q), each (m, V) → (ℓ per row (m,), d ℓ/d the drafter's logits (m, V))
Divergence = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass(frozen=True, eq=False)
class _Rows:
    """The flat rows a chunked pass runs over and what it forms on them."""

    labels: Tensor  # (M,) long, −100 invalid
    row_w: Tensor  # (M,) each row's weight in the total (slot weight / normaliser; 0: no loss)
    bs: int
    chunk_rows: int  # blocks per chunk
    slot_loss: SlotLoss
    grads: _Grads
    # D-PACE: per-row ℓ (M,) → the row weights (detached); row_w then only marks the live rows
    reweight: Callable[[Tensor], Tensor] | None = None


class _PassOut(NamedTuple):
    """What one chunked pass forms."""

    total: Tensor  # Σ row_w·ℓ
    per: Tensor  # (M,) per-row ℓ, 0 where row_w is 0
    preds: Tensor  # (M,) argmax ids
    gh: Tensor | None  # (M, H + r) d total/d hidden
    gw: Tensor | None  # (V, H) d total/d weight
    ge: Tensor | None  # (V, r) d total/d extra


class _ChunkedLinearLoss(torch.autograd.Function):
    """Σ_i row_w[i] · ℓ_i over flat slots, logits = h @ Wᵀ computed chunk by chunk; also returns argmax ids.

    With `reweight` (D-PACE), row_w only marks the live rows (≠ 0) and the weights come from the per-row losses:
    w = reweight(ℓ) (detached), total = Σ w_i ℓ_i. The gradient w.r.t. the hidden states is then taken unweighted in
    the same pass and scaled by w afterwards (exact, since w is a constant of the backward); a trainable head
    (its gradient sums over rows) needs the weights first, so it gets a loss-only pass before the gradient pass."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, extra: Tensor | None, rows: _Rows):  # type: ignore[override]
        # hidden: (M, H) with M = N·bs (H + r with `extra`); weight: (V, H); extra: (V, r) or None
        head, need = LMHead(weight, extra), rows.grads
        if rows.reweight is None:
            out = _chunked_pass(hidden, head, rows)
        elif need.weight or need.extra:
            first = _chunked_pass(hidden, head, dataclasses.replace(rows, grads=_NO_GRADS))
            out = _chunked_pass(hidden, head, dataclasses.replace(rows, row_w=rows.reweight(first.per)))  # (M,)
        else:
            live = (rows.row_w != 0).to(rows.row_w.dtype)
            out = _chunked_pass(hidden, head, dataclasses.replace(rows, row_w=live))
            w = rows.reweight(out.per).to(out.per.dtype)  # (M,)
            out = out._replace(total=(out.per * w).sum())
            if out.gh is not None:
                out.gh.mul_(w[:, None].to(out.gh.dtype))
        ctx.save_for_backward(out.gh, out.gw, out.ge)
        ctx.weight_dtype = weight.dtype
        ctx.extra_dtype = extra.dtype if extra is not None else None
        ctx.mark_non_differentiable(out.preds)
        return out.total, out.preds

    @staticmethod
    def backward(ctx, grad_total: Tensor, grad_preds: Tensor):  # type: ignore[override]
        gh, gw, ge = ctx.saved_tensors
        d_h = gh * grad_total.to(gh.dtype) if gh is not None else None
        d_w = (gw * grad_total).to(ctx.weight_dtype) if gw is not None else None
        d_e = (ge * grad_total).to(ctx.extra_dtype) if ge is not None else None
        return d_h, d_w, d_e, None


def _chunked_pass(hidden: Tensor, head: LMHead, rows: _Rows) -> _PassOut:
    """One pass over the rows in chunks → Σ row_w·ℓ, the per-row ℓ, the argmax ids and the gradients of Σ row_w·ℓ
    that `rows.grads` asks for. With `head.extra` (V, r) the logits are hidden[:, :H]·weightᵀ + hidden[:, H:]·extraᵀ:
    the frozen weight's gradient is never formed, only the extra rows' (when they require one)."""
    weight, extra, need = head.weight, head.extra, rows.grads
    m = hidden.shape[0]
    hw = weight.shape[1]
    acc = torch.promote_types(weight.dtype, torch.float32)  # float32 for bf16/fp16, else as given
    total = torch.zeros((), dtype=acc, device=hidden.device)
    per_rows = torch.zeros(m, dtype=acc, device=hidden.device)
    preds = torch.empty(m, dtype=torch.long, device=hidden.device)
    gh = torch.empty_like(hidden) if need.hidden else None
    gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need.weight else None
    ge = torch.zeros(extra.shape, dtype=acc, device=extra.device) if need.extra and extra is not None else None
    want_grad = need.hidden or need.weight or need.extra
    low = weight.dtype if weight.dtype != acc and extra is None and not need.weight else None
    step = rows.chunk_rows * rows.bs
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
        w = rows.row_w[start:end].to(acc)  # (m_c,)
        live = w != 0
        per, g = rows.slot_loss(_Chunk(start, end, logp, rows.labels[start:end].clamp(min=0), want_grad, low))
        per = torch.where(live, per, 0.0)  # (m_c,)
        per_rows[start:end] = per
        total += (per * w).sum()
        if g is None:  # no gradient wanted
            continue
        # d(loss)/d(logits) = w ⊙ g row by row: the row weight scales the products' smaller sides (m_c × H
        # instead of m_c × V), and a row of weight 0 is zeroed (not multiplied: its g may hold inf·0)
        rw = torch.where(live, w, 0.0)[:, None]  # (m_c, 1)
        if gh is not None:
            gh[start:end, :hw] = torch.where(live[:, None], (g.to(weight.dtype) @ weight).to(acc) * rw, 0.0)
        if gh is not None and extra is not None:
            gh[start:end, hw:] = torch.where(live[:, None], (g.to(extra.dtype) @ extra).to(acc) * rw, 0.0)
        if gw is not None or ge is not None:  # a row of weight 0 may hold non-finite g: zero it on both sides
            g = torch.where(live[:, None], g, 0.0)
            hw_rows = torch.where(live[:, None], h.to(acc) * rw, 0.0)  # (m_c, H + r)
        if gw is not None:
            gw += g.t() @ hw_rows[:, :hw]
        if ge is not None:
            ge += g.t() @ hw_rows[:, hw:]
    return _PassOut(total, per_rows, preds, gh, gw, ge)


def _ce(c: _Chunk) -> tuple[Tensor, Tensor | None]:
    """Cross-entropy against the label: ℓ = −log p(label), d ℓ/d z = softmax − onehot."""
    nll = -c.logp.gather(1, c.labels[:, None]).squeeze(1)  # (m_c,)
    if not c.want_grad:
        return nll, None
    rows, lab = torch.arange(c.end - c.start, device=c.logp.device), c.labels
    if c.low_dtype is not None:
        # a lower-precision head and only d/d hidden: softmax − onehot written straight in the head's dtype — the
        # values of computing it in float32 and casting, without the float32 copy
        g = torch.exp(c.logp, out=torch.empty_like(c.logp, dtype=c.low_dtype))
        g[rows, lab] = (c.logp[rows, lab].exp() - 1.0).to(c.low_dtype)
    else:
        g = c.logp.exp()
        g[rows, lab] -= 1.0
    return nll, g


def _topk_kl(c: _Chunk, soft: tuple[Tensor, Tensor], alpha: float) -> tuple[Tensor, Tensor | None]:
    """(1 − α)·KL(q_k ‖ p) + α·CE against the sparse renormalised top-k `soft` (ids (M, k), probs (M, k), rows summing
    to 1, or to 0: hard label only, α = 1); d ℓ/d z = softmax − q_mix, scattered so no (m_c, V) target exists."""
    logp, lab = c.logp, c.labels
    ids = soft[0][c.start : c.end].to(logp.device)  # (m_c, k)
    q = soft[1][c.start : c.end].to(logp.device, logp.dtype)  # (m_c, k)
    a = torch.where(q.sum(-1) > 0, alpha, 1.0).to(logp.dtype)  # (m_c,) no kept entry → hard label
    lp = logp.gather(1, ids)  # (m_c, k)
    kl = torch.where(q > 0, q * (q.log() - lp), 0.0).sum(-1)
    nll = -logp.gather(1, lab[:, None]).squeeze(1)
    per = (1 - a) * kl + a * nll
    if not c.want_grad:
        return per, None
    rows = torch.arange(c.end - c.start, device=logp.device)
    g = logp.exp()  # g = softmax − q_mix, one chunk at a time
    g.scatter_add_(1, ids, -(1 - a)[:, None] * q)
    g[rows, lab] -= a
    return per, g


def _against_target(c: _Chunk, target: TargetLogits, bs: int, divergence: Divergence) -> tuple[Tensor, Tensor | None]:
    """A divergence from the target's distribution: `target` (M, V) rows, or a callable over blocks."""
    t = target(c.start // bs, c.end // bs) if callable(target) else target[c.start : c.end]
    logp = torch.log_softmax(t.reshape(c.end - c.start, -1).detach().to(c.logp.device, c.logp.dtype), dim=-1)
    per, g = divergence(logp.exp(), logp, c.logp.exp(), c.logp)  # the target's p (m_c, V), the drafter's q
    return per, g if c.want_grad else None


def _kl(p: Tensor, logp: Tensor, q: Tensor, logq: Tensor) -> tuple[Tensor, Tensor]:
    """KL(p ‖ q), d/dz = q − p."""
    return torch.where(p > 0, p * (logp - logq), 0.0).sum(-1), q - p  # (m,), (m, V)


def _acceptance(p: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """α = Σ_v min(p_v, q_v) (m,), the acceptance rate of speculative sampling, and dα/dz (m, V)."""
    overlap = torch.minimum(p, q).sum(-1)  # α (m,)
    below = (q < p).to(q.dtype)  # where min(p, q) is q: dα/dq = 1 there
    return overlap, q * (below - (below * q).sum(-1, keepdim=True))  # dα/dz = q ⊙ (c − ⟨c, q⟩)


def _tv(p: Tensor, logp: Tensor, q: Tensor, logq: Tensor) -> tuple[Tensor, Tensor]:
    """TV = 1 − α = ½‖p − q‖₁."""
    overlap, d_overlap = _acceptance(p, q)
    return 1.0 - overlap, -d_overlap


def _nla(p: Tensor, logp: Tensor, q: Tensor, logq: Tensor) -> tuple[Tensor, Tensor]:
    """−log α, α floored at NLA_EPS (no gradient below the floor)."""
    overlap, d_overlap = _acceptance(p, q)
    floor = overlap.clamp_min(NLA_EPS)
    return -floor.log(), torch.where((overlap > NLA_EPS)[:, None], -d_overlap / floor[:, None], 0.0)


def _lk(
    p: Tensor, logp: Tensor, q: Tensor, logq: Tensor, *, eta: float = 0.0, lam: float | None = None
) -> tuple[Tensor, Tensor]:
    """λ·KL(p ‖ q) + (1 − λ)·TV with λ not differentiated: λ = exp(−η·α) per row (lk_hybrid), or the batch's one
    `lam` (lk_lambda, from `_batch_lambda`)."""
    kl, g_kl = _kl(p, logp, q, logq)
    overlap, d_overlap = _acceptance(p, q)
    lam_t = (torch.full_like(overlap, lam) if lam is not None else torch.exp(-eta * overlap))[:, None]  # (m, 1)
    tv = 1.0 - overlap
    return lam_t[:, 0] * kl + (1 - lam_t[:, 0]) * tv, lam_t * g_kl - (1 - lam_t) * d_overlap


def _batch_lambda(hidden: Tensor, head: LMHead, tv_rows: _Rows, spec: LossSpec) -> float:
    """SpecForge's λ = scale·exp(−decay·ᾱ) for `lk_lambda`: ᾱ = Σ w·α / Σ w over the live rows, from a TV pass
    (`tv_rows`) without gradients (one more LM-head product over the rows)."""
    with torch.no_grad():
        extra = head.extra.detach() if head.extra is not None else None
        per = _chunked_pass(hidden.detach(), LMHead(head.weight.detach(), extra), tv_rows).per
        w = tv_rows.row_w.to(per.dtype)
        mean_alpha = 1.0 - float((w * per).sum() / w.sum().clamp_min(torch.finfo(per.dtype).tiny))
    return float(spec.lk_kl_scale) * math.exp(-float(spec.lk_kl_decay) * mean_alpha)


def _divergence(spec: LossSpec, hidden: Tensor, head: LMHead, rows: _Rows) -> Divergence:
    """The per-row divergence of a kind in DISTRIBUTION_KINDS (lk_lambda: its λ for the batch computed here, from
    `rows` whose slot loss is TV)."""
    if spec.kind == "lk_hybrid":
        return functools.partial(_lk, eta=float(spec.lk_eta))
    if spec.kind == "lk_lambda":
        return functools.partial(_lk, lam=_batch_lambda(hidden, head, rows, spec))
    return {"kl": _kl, "tv": _tv, "nla": _nla}[spec.kind]


def _slot_weights(spec: LossSpec, valid: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Position weights of the valid slots (N, bs) and the normaliser: the fixed `spec.weights` (default the decay;
    D-PACE: the draft-slot marks, its weights come per row from `_dpace_row_weights`)."""
    bs = valid.shape[1]
    base = spec.weights
    if base is None:
        base = draft_slot_weights(bs) if spec.position_weights == "dpace" else decay_weights(bs)
    w = base.to(device=valid.device, dtype=dtype)
    if w.shape != (bs,):
        raise ValueError(f"weights must be ({bs},), got {tuple(w.shape)}")
    slot_w = w[None] * valid  # (N, bs)
    norm = (
        slot_w.sum() if spec.normalizer is None else torch.as_tensor(spec.normalizer, dtype=dtype, device=valid.device)
    )
    return slot_w, norm


def _dpace_row_weights(per: Tensor, slot_w: Tensor, live_rows: Tensor | None, alpha: float, scale: Tensor) -> Tensor:
    """Per-row CE of the live rows (M_live,) → their D-PACE weights / N, from the CE of whole blocks (N, bs)."""
    n, bs = slot_w.shape
    ce = torch.zeros(n * bs, dtype=per.dtype, device=per.device)
    ce = ce.index_copy(0, live_rows, per) if live_rows is not None else per
    dw = dpace_weights(ce.view(n, bs), slot_w > 0, alpha).reshape(-1)  # (M,)
    dw = dw[live_rows] if live_rows is not None else dw
    return dw / scale.to(per.dtype)


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


def _check_objective(spec: LossSpec, target: LossTarget) -> None:
    """Raise ValueError when `block_loss`'s objective and its target side do not go together."""
    kind, ce_weight, position_weights = spec.kind, spec.ce_weight, spec.position_weights
    topk_ids, topk_logprobs = target.topk_ids, target.topk_logprobs
    if kind not in ("ce", "topk", *DISTRIBUTION_KINDS):
        raise ValueError(f"kind must be 'ce', 'topk' or one of {DISTRIBUTION_KINDS}, got {kind!r}")
    if (kind in DISTRIBUTION_KINDS) != (target.logits is not None):
        raise ValueError(f"target logits are required for kind in {DISTRIBUTION_KINDS} and only allowed with them")
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


def _checked_head(hidden: Tensor, head: LMHead, labels: Tensor) -> LMHead:
    """The head checked against the shapes of `hidden` and `labels`; a frozen weight under autocast cast once to the
    autocast dtype (not in every chunk's two products)."""
    h_dim = hidden.shape[-1]
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden's leading dims {tuple(hidden.shape[:-1])}")
    weight, extra = head.weight, head.extra
    r = extra.shape[-1] if extra is not None else 0
    if weight.dim() != 2 or weight.shape[1] != h_dim - r:
        raise ValueError(f"the head's weight must be (V, {h_dim - r}), got {tuple(weight.shape)}")
    if extra is not None and (extra.dim() != 2 or extra.shape[0] != weight.shape[0]):
        raise ValueError(f"the head's extra rows must be ({weight.shape[0]}, r), got {tuple(extra.shape)}")
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and not weight.requires_grad:
        return LMHead(_cast_frozen(weight, torch.get_autocast_dtype(dev)), extra)
    return head


def _target_rows(target: LossTarget, labels: Tensor, vocab: int) -> tuple[TargetLogits | None, tuple | None]:
    """The target side over the flat rows: logits (M, V) (a callable as given), and the sparse top-k (ids, probs)."""
    logits = target.logits
    if isinstance(logits, Tensor):
        if logits.shape[:-1] != labels.shape or logits.shape[-1] != vocab:
            raise ValueError(f"target logits must be {(*tuple(labels.shape), vocab)}, got {tuple(logits.shape)}")
        logits = logits.reshape(-1, vocab)
    soft = None
    if target.topk_ids is not None and target.topk_logprobs is not None:
        soft = sparse_topk_target(target.topk_ids, target.topk_logprobs, labels.shape, vocab)
    return logits, soft


def block_loss(
    hidden: Tensor,
    head: Tensor | LMHead,
    labels: Tensor,
    spec: LossSpec | None = None,
    target: LossTarget | None = None,
) -> LossOutput:
    """Weighted block loss over drafter outputs.

    hidden: (N, bs, H) final-normed drafter states (any leading dims (..., bs, H) are flattened to N; (…, H + r)
        with the head's extra rows);
    head: the weight (V, H) (the target's LM head, or the reduced draft head), or an `LMHead` with extra rows;
    labels: (N, bs) long, −100 invalid (they mark validity and accuracy for every kind);
    spec: the objective (`LossSpec`; default plain CE with the decay weights) —
        kind "ce" (labels), one of DISTRIBUTION_KINDS against the target's distribution ("kl": KL(target ‖ draft),
        "tv", "nla", "lk_hybrid", "lk_lambda"), or "topk" ((1 − ce_weight)·KL(renormalised top-k ‖ draft) +
        ce_weight·CE; see the module docstring);
        position_weights "decay" (the fixed weights) or "dpace" (kind "ce" only): each valid slot's CE is weighted by
        `dpace_weights` of its block (α = dpace_alpha), computed from this very forward and detached; the weights
        then only mark the draft slots (default `draft_slot_weights`: all but slot 0), so the default normaliser
        N is the number of valid draft slots Σ m_j — known from the labels before the forward, hence one global
        value across micro-batches and ranks, and a loss scale that does not move with the drafter's confidence;
    target: the batch's target side (`LossTarget`): logits for DISTRIBUTION_KINDS, the stored top-k for "topk".
    """
    spec, target = spec or LossSpec(), target or LossTarget()
    _check_objective(spec, target)
    head = _checked_head(hidden, head if isinstance(head, LMHead) else LMHead(head), labels)
    bs, vocab = hidden.shape[-2], head.weight.shape[0]
    flat_h = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)  # (M, H), M = N·bs
    flat_lab = labels.reshape(-1).long()  # (M,)
    n = flat_lab.numel() // bs if bs else 0
    acc = torch.promote_types(head.weight.dtype, torch.float32)
    valid = (flat_lab != -100).view(n, bs)  # (N, bs)
    slot_w, norm = _slot_weights(spec, valid, acc)  # (N, bs), ()
    scale = norm.clamp_min(torch.finfo(acc).tiny)
    row_w = (slot_w / scale).reshape(-1)  # (M,)
    logits, soft = _target_rows(target, labels, vocab)
    live_rows, all_labels = None, flat_lab
    if not callable(logits) and flat_lab.numel():
        # Rows with weight 0 (slot 0 — the given anchor — and slots without a label) add nothing to the loss or
        # the gradients: the LM head runs only over the rows that carry one (a quarter fewer at block size 4).
        live_rows = (row_w != 0).nonzero().squeeze(1)  # (M_live,)
        flat_h, flat_lab, row_w = flat_h.index_select(0, live_rows), flat_lab[live_rows], row_w[live_rows]
        logits = logits[live_rows] if logits is not None else None
        soft = (soft[0][live_rows], soft[1][live_rows]) if soft is not None else None
    grad_on = torch.is_grad_enabled()
    grads = _Grads(
        grad_on and flat_h.requires_grad,
        grad_on and head.weight.requires_grad,
        grad_on and head.extra is not None and head.extra.requires_grad,
    )
    rows = _Rows(flat_lab, row_w, bs, spec.chunk_rows(bs, vocab), _ce, grads)
    if soft is not None:
        rows = dataclasses.replace(rows, slot_loss=functools.partial(_topk_kl, soft=soft, alpha=float(spec.ce_weight)))
    elif logits is not None:
        against = functools.partial(_against_target, target=logits, bs=bs)
        tv_rows = dataclasses.replace(rows, slot_loss=functools.partial(against, divergence=_tv), grads=_NO_GRADS)
        divergence = _divergence(spec, flat_h, head, tv_rows)
        rows = dataclasses.replace(rows, slot_loss=functools.partial(against, divergence=divergence))
    elif spec.position_weights == "dpace":
        reweight = functools.partial(
            _dpace_row_weights, slot_w=slot_w, live_rows=live_rows, alpha=spec.dpace_alpha, scale=scale
        )
        rows = dataclasses.replace(rows, reweight=reweight)
    loss, preds = _ChunkedLinearLoss.apply(flat_h, head.weight, head.extra, rows)
    if live_rows is not None:  # rows the head did not run over: slot 0 is the given anchor (counted as right),
        full = torch.full((n, bs), -1, dtype=torch.long, device=preds.device)  # the others predict nothing
        full[:, 0] = all_labels.view(n, bs)[:, 0]
        preds = full.view(-1).index_copy_(0, live_rows, preds)
    with torch.no_grad():
        correct = ((preds.view(n, bs) == all_labels.view(n, bs)) & valid).sum(0)  # (bs,)
        counts = valid.sum(0)  # (bs,)
        accuracy = correct.float() / counts.clamp_min(1).float()
    return LossOutput(
        loss=loss, accuracy=accuracy, valid_counts=counts, correct_counts=correct, weight_sum=slot_w.sum().detach()
    )
