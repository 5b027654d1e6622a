"""Tests of dflashkit.train.losses: decay weights, chunked CE/KL (values and gradients equal the unchunked
computation), metrics and the estimated acceptance length."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflashkit.train.losses import LossSpec, LossTarget, block_loss, decay_weights, default_gamma, estimated_tau


def test_decay_weights_values() -> None:
    for bs, gamma in ((16, 7.0), (10, 5.0), (8, 4.0)):
        assert default_gamma(bs) == gamma
        w = decay_weights(bs)
        assert w.shape == (bs,) and w[0] == 0 and w[1] == 1
        expected = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, bs)])
        torch.testing.assert_close(w, expected)
    assert default_gamma(4) == 2.0 and default_gamma(2) == 1.0
    assert default_gamma(32) == pytest.approx(7 + 16 / 3)
    torch.testing.assert_close(decay_weights(3, gamma=2.0), torch.tensor([0.0, 1.0, math.exp(-0.5)]))
    with pytest.raises(ValueError):
        decay_weights(1)


def _problem(seed: int, n: int = 7, bs: int = 4, h: int = 6, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, bs, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n, bs), generator=g)
    labels[torch.rand(n, bs, generator=g) < 0.25] = -100
    labels[0] = -100  # one padding block
    target = torch.randn(n, bs, v, generator=g, dtype=torch.float64) * 2
    return hidden, weight, labels, target


def _unchunked(hidden, weight, labels, weights, target=None):
    logits = hidden @ weight.t()  # (N, bs, V)
    valid = labels != -100
    if target is None:
        per = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100)
        per = per.view(labels.shape)
    else:
        per = F.kl_div(logits.log_softmax(-1), target.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    w = weights[None] * valid
    return (per * w).sum() / w.sum()


@pytest.mark.parametrize("kind", ["ce", "kl"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 7, None])
def test_chunked_loss_and_grads_equal_unchunked(kind: str, chunk: int | None) -> None:
    hidden, weight, labels, target = _problem(0)
    weights = decay_weights(4).double()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _unchunked(h1, w1, labels, weights, target if kind == "kl" else None)
    ref.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    spec = LossSpec(weights=weights, kind=kind, chunk_size=chunk)
    out = block_loss(h2, w2, labels, spec, LossTarget(logits=target if kind == "kl" else None))
    out.loss.backward()
    torch.testing.assert_close(out.loss.double(), ref.double())
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)


def test_callable_target_and_frozen_head() -> None:
    hidden, weight, labels, target = _problem(1)
    calls = []

    def per_chunk(start: int, end: int) -> torch.Tensor:
        calls.append((start, end))
        return target[start:end]

    h = hidden.clone().requires_grad_()
    out = block_loss(h, weight, labels, LossSpec(kind="kl", chunk_size=3), LossTarget(logits=per_chunk))
    out.loss.backward()
    assert calls == [(0, 3), (3, 6), (6, 7)]
    assert weight.grad is None and h.grad is not None
    h_ref = hidden.clone().requires_grad_()
    ref = _unchunked(h_ref, weight, labels, decay_weights(4).double(), target)
    ref.backward()
    torch.testing.assert_close(out.loss.double(), ref)
    torch.testing.assert_close(h.grad, h_ref.grad)


def test_kl_to_one_hot_target_approaches_ce() -> None:
    hidden, weight, labels, _ = _problem(2)
    sharp = F.one_hot(labels.clamp(min=0), weight.shape[0]).double() * 40.0  # target ≈ one-hot on the label
    ce = block_loss(hidden, weight, labels).loss
    kl = block_loss(hidden, weight, labels, LossSpec(kind="kl", chunk_size=2), LossTarget(logits=sharp)).loss
    torch.testing.assert_close(kl, ce, rtol=1e-6, atol=1e-6)


def test_accuracy_counts_and_tau_on_hand_made_logits() -> None:
    v = bs = 3
    weight = torch.eye(v)  # logits = hidden
    preds = torch.tensor([[0, 1, 2], [0, 1, 0], [0, 2, 2], [0, 1, 1]])  # argmax per slot (N=4, bs=3)
    hidden = F.one_hot(preds, v).float() * 5.0
    labels = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, -100]])
    out = block_loss(hidden, weight, labels, LossSpec(weights=decay_weights(bs), chunk_size=1))
    assert out.valid_counts.tolist() == [4, 4, 3]
    assert out.correct_counts.tolist() == [4, 3, 2]
    torch.testing.assert_close(out.accuracy, torch.tensor([1.0, 0.75, 2 / 3]))
    assert out.tau == pytest.approx(1 + 0.75 + 0.75 * 2 / 3)
    assert float(out.weight_sum) == pytest.approx(4 * 1.0 + 3 * math.exp(-1 / default_gamma(3)))


def test_estimated_tau() -> None:
    assert estimated_tau([1.0, 0.5, 0.5, 0.0]) == pytest.approx(1 + 0.5 + 0.25)
    assert estimated_tau(torch.ones(16)) == pytest.approx(16.0)
    assert estimated_tau([0.3]) == 1.0


def test_no_valid_slot_gives_zero_loss_and_finite_grads() -> None:
    hidden = torch.randn(2, 4, 6, requires_grad=True)
    weight = torch.randn(9, 6)
    out = block_loss(hidden, weight, torch.full((2, 4), -100))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.isfinite(hidden.grad).all() and not hidden.grad.any()
    assert out.valid_counts.sum() == 0 and out.accuracy.eq(0).all()


def test_normalizer_and_leading_dims() -> None:
    hidden, weight, labels, _ = _problem(3, n=6)
    base = block_loss(hidden, weight, labels)
    scaled = block_loss(hidden, weight, labels, LossSpec(normalizer=2 * base.weight_sum))
    torch.testing.assert_close(scaled.loss, base.loss / 2)
    batched = block_loss(hidden.view(2, 3, 4, -1), weight, labels.view(2, 3, 4))
    torch.testing.assert_close(batched.loss, base.loss)


def test_bad_arguments() -> None:
    hidden, weight, labels, target = _problem(4)
    with pytest.raises(ValueError):
        block_loss(hidden, weight, labels, LossSpec(kind="kl"))
    with pytest.raises(ValueError):
        block_loss(hidden, weight, labels, LossSpec(), LossTarget(logits=target))
    with pytest.raises(ValueError):
        block_loss(hidden, weight[:, :3], labels)


def test_bf16_inputs_close_to_float32() -> None:
    hidden, weight, labels, _ = _problem(5)
    h16 = hidden.to(torch.bfloat16).requires_grad_()
    out = block_loss(h16, weight.to(torch.bfloat16), labels, LossSpec(chunk_size=2))
    out.loss.backward()
    ref = block_loss(h16.detach().float(), weight.to(torch.bfloat16).float(), labels)
    assert out.loss.dtype == torch.float32 and h16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=2e-2)


def test_under_bf16_autocast_the_frozen_head_is_cast_once_and_the_loss_follows_fp32() -> None:
    """A bf16 run's LM-head products: the frozen head is cast once and the same copy reused while the head is
    unchanged (a new one after an in-place change); loss and gradient follow fp32's within bf16's rounding."""
    from dflashkit.train.losses import _cast_frozen

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, 16, generator=g, requires_grad=True)
    head = torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (6, 4), generator=g)
    ref = block_loss(hidden, head, labels)
    (grad_ref,) = torch.autograd.grad(ref.loss, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block_loss(hidden, head, labels)
        first = _cast_frozen(head, torch.bfloat16)
        assert _cast_frozen(head, torch.bfloat16) is first and first.dtype == torch.bfloat16
        (grad,) = torch.autograd.grad(out.loss, hidden)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(out.loss, ref.loss, rtol=2e-2, atol=0)
    torch.testing.assert_close(grad, grad_ref, rtol=5e-2, atol=5e-3)
    head.mul_(2)  # a changed head is cast again
    again = _cast_frozen(head, torch.bfloat16)
    assert again is not first and torch.equal(again, head.to(torch.bfloat16))
    assert _cast_frozen(head, torch.float32) is head


def test_a_bf16_heads_gradient_equals_float32_softmax_cast_to_bf16() -> None:
    """With a bf16 head the chunked pass writes softmax − onehot straight in bf16: exactly the float32 values cast."""
    from dflashkit.train.losses import LMHead, _ce, _chunked_pass, _Grads, _Rows

    g = torch.Generator().manual_seed(3)
    h = torch.randn(12, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(40, 16, generator=g).to(torch.bfloat16)
    lab = torch.randint(0, 40, (12,), generator=g)
    row_w = torch.rand(12, generator=g)
    row_w[3] = 0.0
    rows = _Rows(labels=lab, row_w=row_w, bs=4, chunk_rows=2, slot_loss=_ce, grads=_Grads(True, False, False))
    gh = _chunked_pass(h, LMHead(w), rows).gh
    logp = torch.log_softmax(F.linear(h, w), dim=-1, dtype=torch.float32)
    ref = logp.exp()
    ref[torch.arange(12), lab] -= 1.0
    want = (ref.to(torch.bfloat16) @ w).float() * row_w[:, None]
    want[3] = 0.0
    assert torch.equal(gh, want.to(torch.bfloat16))
