"""The weight-stationary products for decoding's few rows: the same values as F.linear, fallbacks unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.target.products import FEW_ROWS, linear_few_rows, route_linears


def _bound(x, w):
    # float32 dot products of length H in any summation order: |error| ≤ H·eps·Σ|x_i w_i| (loose, never flaky)
    return x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t())


def test_equals_f_linear_for_every_small_shape():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3000, 64, generator=g), torch.randn(3000, generator=g)
    for shape in [(2, 64), (3, 64), (1, 2, 64), (1, 5, 64), (2, 8, 64), (16, 64)]:
        x = torch.randn(*shape, generator=g)
        got, ref = linear_few_rows(x, w), F.linear(x, w)
        assert got.shape == ref.shape == (*shape[:-1], 3000)
        assert ((got - ref).abs() <= _bound(x, w)).all()
        got_b = linear_few_rows(x, w, b)
        assert ((got_b - F.linear(x, w, b)).abs() <= _bound(x, w) + 1e-6 * b.abs()).all()


def test_one_row_many_rows_and_autograd_run_f_linear_exactly():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(500, 32, generator=g)
    for rows in (1, FEW_ROWS + 1):  # an AR step (HF generate stays stock), a long sequence
        x = torch.randn(rows, 32, generator=g)
        assert torch.equal(linear_few_rows(x, w), F.linear(x, w))
    xg = torch.randn(4, 32, generator=g, requires_grad=True)
    out = linear_few_rows(xg, w)
    assert torch.equal(out, F.linear(xg, w)) and out.requires_grad  # training keeps autograd's path
    out.sum().backward()
    assert xg.grad is not None
    with torch.no_grad(), pytest.raises(RuntimeError):  # dtype mismatch: F.linear's own error
        linear_few_rows(torch.randn(3, 32, generator=g).double(), w)
    assert linear_few_rows(torch.zeros(0, 32), w).shape == (0, 500)


def test_route_linears_keeps_values_and_is_idempotent():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8, bias=False))
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = net(x)
        assert route_linears(net) == 2 and route_linears(net) == 0
        got = net(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_target_verifier_logits_match_the_model_head(tiny_llama_dir):
    from dflashkit.target.model import Target

    target = Target.load(str(tiny_llama_dir))
    h = torch.randn(1, 4, target.hidden_size)
    got = target.verifier_logits(h)
    with torch.no_grad():
        ref = F.linear(target.final_norm(h), target.lm_head.weight)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_min_rows_one_takes_the_weight_stationary_path_for_a_single_row():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(700, 48, generator=g)
    x = torch.randn(1, 1, 48, generator=g)
    got = linear_few_rows(x, w, min_rows=1)
    assert got.shape == (1, 1, 700)
    assert ((got - F.linear(x, w)).abs() <= _bound(x, w)).all()
    from dflashkit.target.products import stock_products

    with stock_products():  # inside stock_products(): F.linear exactly
        assert torch.equal(linear_few_rows(x, w, min_rows=1), F.linear(x, w))
