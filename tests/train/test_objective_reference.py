"""`block_loss` (chunked, hand-written gradients) equals `dflashkit.train.objective_reference` — the objectives written
plainly in float64 Python loops — for every objective and both slot weightings, value and gradient."""

from __future__ import annotations

import pytest
import torch

from dflashkit.train.losses import LossSpec, LossTarget, block_loss, default_gamma
from dflashkit.train.objective_reference import block_loss64

CASES = [
    ("ce", {}, None),
    ("ce", {}, 0.4),  # D-PACE
    ("kl", {}, None),
    ("topk", {"topk_ce_weight": 0.3}, None),
    ("tv", {}, None),
    ("nla", {}, None),
    ("lk_hybrid", {"eta": 2.0}, None),
    ("lk_lambda", {"s": 1.2, "d": 0.8}, None),
]


@pytest.mark.parametrize("kind,opts,dpace", CASES)
def test_block_loss_equals_the_float64_definitions(kind, opts, dpace) -> None:
    g = torch.Generator().manual_seed(5)
    n, bs, h, v, k = 3, 4, 5, 7, 3
    hidden = torch.randn(n, bs, h, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n, bs), generator=g)
    labels[1, 2] = -100
    target = torch.randn(n, bs, v, generator=g, dtype=torch.float64)
    probs = torch.softmax(target, -1)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n * bs)]).view(n, bs, k)
    lps = torch.log_softmax(torch.randn(n, bs, k, generator=g, dtype=torch.float64), -1)
    kw: dict = {}
    t = LossTarget()
    if kind in ("kl", "tv", "nla", "lk_hybrid", "lk_lambda"):
        t = LossTarget(logits=target)
    if kind == "topk":
        t = LossTarget(topk_ids=ids, topk_logprobs=lps)
        kw["ce_weight"] = opts["topk_ce_weight"]
    if kind == "lk_hybrid":
        kw["lk_eta"] = opts["eta"]
    if kind == "lk_lambda":
        kw.update(lk_kl_scale=opts["s"], lk_kl_decay=opts["d"])
    if dpace is not None:
        kw.update(position_weights="dpace", dpace_alpha=dpace)
    got = block_loss(hidden, head, labels, LossSpec(kind=kind, **kw), t).loss
    (grad,) = torch.autograd.grad(got, hidden)
    h2 = hidden.detach().clone().requires_grad_(True)
    ref = block_loss64(
        kind, h2 @ head.t(), labels, probs, gamma=default_gamma(bs), dpace_alpha=dpace, ids=ids, lps=lps, **opts
    )
    (want,) = torch.autograd.grad(ref, h2)
    # block_loss keeps its slot weights and the renormalised top-k in float32 (2⁻²⁴ relative); the rest is float64
    torch.testing.assert_close(got.detach(), ref.detach(), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-8)
