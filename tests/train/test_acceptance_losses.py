"""The acceptance-rate objectives (`loss: tv | nla | lk_hybrid | lk_lambda`): the chunked loss and its hand-written
gradients equal a float64 reference written with plain autograd from the definitions (vllm-project/speculators' tv,
neg-log-acceptance and hybrid LK losses; SpecForge's LK "lambda" with one λ per batch), slot by slot in Python loops;
and the training options around them."""

from __future__ import annotations

import math

import pytest
import torch

from dflashkit.errors import ConfigError
from dflashkit.train.config import TrainConfig
from dflashkit.train.losses import NLA_EPS, LossSpec, LossTarget, block_loss, decay_weights


def _slot_loss(kind: str, p: torch.Tensor, z: torch.Tensor, eta: float) -> torch.Tensor:
    """One slot, float64, from the definitions: p the target's distribution (V,), z the draft logits (V,)."""
    q = torch.softmax(z, -1)
    alpha = sum(min(p[v], q[v]) for v in range(len(p)))  # a Python loop over the vocabulary
    kl = sum(p[v] * (torch.log(p[v]) - torch.log_softmax(z, -1)[v]) for v in range(len(p)) if p[v] > 0)
    if kind == "kl":
        return kl
    if kind == "tv":
        return 1 - alpha
    if kind == "nla":
        return -torch.log(torch.clamp(alpha, min=NLA_EPS))
    lam = math.exp(-eta * float(alpha.detach()))  # α not differentiated
    return lam * kl + (1 - lam) * (1 - alpha)


def _reference(kind, hidden, weight, labels, target, eta):
    """Σ_slots w_k ℓ / Σ_slots w_k over valid slots (decay weights), by Python loops. lk_lambda: one λ for the batch,
    s·exp(−d·ᾱ) with ᾱ the weighted mean acceptance (eta = (s, d)), then λ·KL + (1 − λ)·TV per slot."""
    n, bs, _ = hidden.shape
    w = decay_weights(bs).double()
    if kind == "lk_lambda":
        s, d = eta
        acc, wa = 0.0, 0.0
        for i in range(n):
            for k in range(bs):
                if labels[i, k] != -100 and w[k] > 0:
                    q = torch.softmax(weight.detach() @ hidden[i, k].detach(), -1)
                    p = torch.softmax(target[i, k], -1)
                    acc += float(w[k]) * float(sum(min(p[v], q[v]) for v in range(len(p))))
                    wa += float(w[k])
        lam = s * math.exp(-d * acc / wa)
        kinds = ("kl", "tv")
        total = torch.zeros((), dtype=torch.float64)
        wsum = 0.0
        for i in range(n):
            for k in range(bs):
                if labels[i, k] == -100 or w[k] == 0:
                    continue
                z = weight @ hidden[i, k]
                p = torch.softmax(target[i, k], -1)
                kl, tv = (_slot_loss(x, p, z, 0.0) for x in kinds)
                total = total + w[k] * (lam * kl + (1 - lam) * tv)
                wsum += float(w[k])
        return total / wsum
    total, wsum = torch.zeros((), dtype=torch.float64), 0.0
    for i in range(n):
        for k in range(bs):
            if labels[i, k] == -100 or w[k] == 0:
                continue
            z = weight @ hidden[i, k]  # (V,)
            p = torch.softmax(target[i, k], -1)
            total = total + w[k] * _slot_loss(kind, p, z, eta)
            wsum += float(w[k])
    return total / wsum


@pytest.mark.parametrize("kind", ["tv", "nla", "lk_hybrid", "lk_lambda"])
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_acceptance_losses_and_gradients_equal_a_float64_reference(kind, chunk) -> None:
    g = torch.Generator().manual_seed(11)
    n, bs, h, v = 5, 4, 6, 9
    hidden = torch.randn(n, bs, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n, bs), generator=g)
    labels[torch.rand(n, bs, generator=g) < 0.2] = -100
    target = torch.randn(n, bs, v, generator=g, dtype=torch.float64) * 2
    eta = (1.3, 0.7) if kind == "lk_lambda" else 2.5
    lk = dict(lk_kl_scale=eta[0], lk_kl_decay=eta[1]) if kind == "lk_lambda" else dict(lk_eta=eta)
    out = block_loss(hidden, weight, labels, LossSpec(kind=kind, chunk_size=chunk, **lk), LossTarget(logits=target))
    gh, gw = torch.autograd.grad(out.loss, (hidden, weight))
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = _reference(kind, h2, w2, labels, target, eta)
    rh, rw = torch.autograd.grad(ref, (h2, w2))
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-11)


def test_tv_is_half_the_l1_distance_and_zero_at_the_target() -> None:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, 2, 7, generator=g, dtype=torch.float64)
    weight = torch.eye(7, dtype=torch.float64)
    labels = torch.tensor([[-100, 1]])
    target = torch.randn(1, 2, 7, generator=g, dtype=torch.float64)
    tv = block_loss(z, weight, labels, LossSpec(kind="tv"), LossTarget(logits=target)).loss
    half_l1 = 0.5 * (torch.softmax(z[0, 1], -1) - torch.softmax(target[0, 1], -1)).abs().sum()
    torch.testing.assert_close(tv, half_l1)
    same = block_loss(target.clone(), weight, labels, LossSpec(kind="tv"), LossTarget(logits=target)).loss
    assert float(same) == pytest.approx(0.0, abs=1e-12)
    nla = block_loss(target.clone(), weight, labels, LossSpec(kind="nla"), LossTarget(logits=target)).loss
    assert float(nla) == pytest.approx(0.0, abs=1e-12)  # −log 1


def test_the_training_options_around_the_acceptance_losses() -> None:
    assert TrainConfig(loss="tv").loss == "tv" and TrainConfig(loss="lk_hybrid", lk_eta=5.0).lk_eta == 5.0
    with pytest.raises(ConfigError, match=r"lk_eta = 5.0: expected unset: it only applies to loss: lk_hybrid"):
        TrainConfig(loss="tv", lk_eta=5.0).validate()
    with pytest.raises(ConfigError, match='position_weights = "dpace": expected loss: ce'):
        TrainConfig(loss="nla", position_weights="dpace").validate()
    with pytest.raises(ConfigError, match="expected one of"):
        TrainConfig(loss="lk").validate()
    assert TrainConfig(loss="lk_lambda", lk_kl_scale=0.8, lk_kl_decay=2.0).lk_kl_decay == 2.0
    with pytest.raises(ConfigError, match=r"lk_kl_decay = 2.0: expected unset: it only applies to loss: lk_lambda"):
        TrainConfig(loss="lk_hybrid", lk_kl_decay=2.0).validate()
