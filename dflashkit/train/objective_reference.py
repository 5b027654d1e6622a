"""Every training objective of `dflashkit.train.losses.block_loss`, written plainly in float64 — the definitions to read
first, and the reference the chunked implementation is tested against (tests/train/test_objective_reference.py).

One block of bs slots: slot 0 holds the given token (weight 0), slot k ≥ 1 drafts the token at anchor + k. For a
slot with draft logits z (V,), label y and the target's distribution p (V,) at that slot, q = softmax(z):

    ce         −log q[y]
    kl         Σ_v p_v (log p_v − log q_v)
    topk       (1 − c)·Σ_j t_j (log t_j − log q[i_j]) + c·ce     t: the stored top-k renormalised, c = topk_ce_weight
    tv         1 − α,  α = Σ_v min(p_v, q_v)                     (the acceptance rate of speculative sampling)
    nla        −log max(α, NLA_EPS)
    lk_hybrid  λ·kl + (1 − λ)·tv,  λ = exp(−η·α)                 (λ a constant of the gradient)
    lk_lambda  λ·kl + (1 − λ)·tv,  λ = s·exp(−d·ᾱ), ᾱ = Σ w·α / Σ w over the batch's valid slots

and the loss is Σ_valid w_k·ℓ_k / Σ_valid w_k, with w_k = exp(−(k − 1)/γ) (w_0 = 0), or D-PACE: per block,
q̃_j = (1 − a)·exp(−ce_j) + a on valid slots (1 elsewhere), C_j = Π_{i≤j} q̃_i, w_j = Σ_{k≥j} m_k·C_k, over N = the
number of valid draft slots (m: validity; CE only).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dflashkit.train.losses import NLA_EPS


def slot_loss(kind: str, z: Tensor, y: int, p: Tensor | None = None, **opts: float) -> Tensor:
    """ℓ of one slot (a float64 scalar, differentiable in z): z (V,) draft logits, y the label, p (V,) the target's
    distribution; opts: eta (lk_hybrid), lam (lk_lambda, already computed), topk (ids, logprobs), topk_ce_weight."""
    logq = torch.log_softmax(z.double(), -1)
    q = logq.exp()
    if kind == "ce":
        return -logq[y]
    if kind == "topk":
        ids, lps = opts["topk"]
        t = torch.softmax(lps.double(), -1)
        kl = sum(t[j] * (torch.log(t[j]) - logq[int(i)]) for j, i in enumerate(ids.tolist()))
        c = opts.get("topk_ce_weight", 0.0)
        return (1 - c) * kl - c * logq[y]
    p = p.double()
    kl = sum(p[v] * (torch.log(p[v]) - logq[v]) for v in range(p.shape[0]) if p[v] > 0)
    alpha = sum(torch.minimum(p[v], q[v]) for v in range(p.shape[0]))
    if kind == "kl":
        return kl
    if kind == "tv":
        return 1 - alpha
    if kind == "nla":
        return -torch.log(torch.clamp(alpha, min=NLA_EPS))
    lam = opts["lam"] if kind == "lk_lambda" else math.exp(-opts["eta"] * float(alpha.detach()))
    return lam * kl + (1 - lam) * (1 - alpha)


def acceptance(z: Tensor, p: Tensor) -> float:
    """α = Σ min(p, softmax(z)) of one slot."""
    q = torch.softmax(z.double(), -1)
    return float(sum(min(float(p[v]), float(q[v])) for v in range(p.shape[0])))


def decay(bs: int, gamma: float) -> list[float]:
    """w_0 = 0, w_k = exp(−(k − 1)/γ)."""
    return [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, bs)]


def dpace(ce: list[float], valid: list[bool], a: float) -> list[float]:
    """D-PACE weights of one block from its per-slot CE and validity."""
    qt = [((1 - a) * math.exp(-c) + a) if m else 1.0 for c, m in zip(ce, valid, strict=True)]
    cum, out = 1.0, []
    running = []
    for x in qt:
        cum *= x
        running.append(cum)
    for j in range(len(ce)):
        out.append(sum(running[k] for k in range(j, len(ce)) if valid[k]) if valid[j] else 0.0)
    return out


def block_loss64(
    kind: str,
    logits: Tensor,
    labels: Tensor,
    target_probs: Tensor | None = None,
    *,
    gamma: float,
    dpace_alpha: float | None = None,
    **opts: float,
) -> Tensor:
    """The loss over blocks: logits (N, bs, V), labels (N, bs) (−100 invalid), target_probs (N, bs, V) for the
    distribution objectives; dpace_alpha set → D-PACE weights (ce only). Python loops, float64."""
    n, bs, _ = logits.shape
    valid = [[int(labels[i, k]) != -100 and k > 0 for k in range(bs)] for i in range(n)]
    if kind == "lk_lambda":  # one λ for the batch, from its weighted mean acceptance
        w, num = decay(bs, gamma), 0.0
        for i in range(n):
            for k in range(bs):
                if valid[i][k]:
                    num += w[k] * acceptance(logits[i, k].detach(), target_probs[i, k])
        mean = num / sum(w[k] for i in range(n) for k in range(bs) if valid[i][k])
        opts = {**opts, "lam": opts["s"] * math.exp(-opts["d"] * mean)}
    total, norm = torch.zeros((), dtype=torch.float64), 0.0
    for i in range(n):
        per = []
        for k in range(bs):
            if not valid[i][k]:
                per.append(None)
                continue
            p = None if target_probs is None else target_probs[i, k]
            extra = {"topk": (opts["ids"][i, k], opts["lps"][i, k])} if kind == "topk" else {}
            per.append(slot_loss(kind, logits[i, k], int(labels[i, k]), p, **opts, **extra))
        if dpace_alpha is None:
            w = decay(bs, gamma)
            norm += sum(w[k] for k in range(bs) if valid[i][k])
        else:
            w = dpace([float(x.detach()) if x is not None else 0.0 for x in per], valid[i], dpace_alpha)
            norm += sum(valid[i])
        for k in range(bs):
            if per[k] is not None:
                total = total + w[k] * per[k]
    return total / norm


__all__ = ["acceptance", "block_loss64", "decay", "dpace", "slot_loss"]
