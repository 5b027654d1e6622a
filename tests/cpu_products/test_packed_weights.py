"""MKL's packed GEMM candidate (target/packed_weights.py): equal to F.linear within float32 rounding, one copy per
weight and row count, never a stale copy, a memory budget past which it computes F.linear, and copies released when
a trial chooses another candidate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.cpu_products import packed_weights, products
from dflashkit.cpu_products.products import PACKED, Chooser, route_linears
from dflashkit.errors import ConfigError
from helpers.choices import set_choice

pytestmark = pytest.mark.skipif(not packed_weights.available(), reason="this torch build has no MKL packed GEMM")


@pytest.fixture(autouse=True)
def _no_copies(monkeypatch):
    monkeypatch.delenv(packed_weights.BUDGET_ENV, raising=False)
    packed_weights.release_all()
    yield
    packed_weights.release_all()


def _bound(x, w):
    return x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t())  # any summation order


def test_equal_to_f_linear_and_one_copy_per_row_count():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    for i, rows in enumerate((1, 2, 4, 17, 64)):
        x = torch.randn(rows, 64, generator=g)
        got = packed_weights.packed_product(x, w, b)
        assert got.shape == (rows, 300) and got.is_contiguous()
        assert ((got - F.linear(x, w, b)).abs() <= _bound(x, w) + 1e-6 * b.abs()).all(), rows
        assert packed_weights.packed_bytes() == (i + 1) * w.numel() * 4
    packed_weights.packed_product(torch.randn(4, 64, generator=g), w, None)  # a width met before: its copy
    assert packed_weights.packed_bytes() == 5 * w.numel() * 4
    assert packed_weights.release([w], 4) == w.numel() * 4 and packed_weights.packed_bytes() == 4 * w.numel() * 4


def test_a_changed_or_replaced_weight_is_packed_again():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(50, 32, generator=g), torch.randn(3, 32, generator=g)
    first = packed_weights.packed_product(x, w, None)
    w.mul_(-2.0)  # in place (a drafter in training): a new version
    again = packed_weights.packed_product(x, w, None)
    assert ((again - F.linear(x, w)).abs() <= _bound(x, w)).all()
    assert ((again + 2.0 * first).abs() <= 3 * _bound(x, w)).all()
    assert packed_weights.packed_bytes() == w.numel() * 4  # the stale copy was replaced, not kept beside
    del w, first, again
    assert not packed_weights._COPIES  # freed with its weight (not at the next packing)
    w2 = torch.randn(50, 32, generator=g)  # may reuse the freed weight's id: never its copy
    assert ((packed_weights.packed_product(x, w2, None) - F.linear(x, w2)).abs() <= _bound(x, w2)).all()


def test_the_budget_and_its_variable(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(40, 16, generator=g), torch.randn(2, 16, generator=g)
    monkeypatch.setenv(packed_weights.BUDGET_ENV, "0")
    assert torch.equal(packed_weights.packed_product(x, w, None), F.linear(x, w))  # past the budget: F.linear
    assert packed_weights.packed_bytes() == 0
    monkeypatch.setenv(packed_weights.BUDGET_ENV, str(w.numel() * 4 * 1.5 / (1 << 30)))  # room for one copy
    packed_weights.packed_product(x, w, None)
    assert torch.equal(packed_weights.packed_product(x[:1], w, None), F.linear(x[:1], w))  # no room for a second
    assert packed_weights.packed_bytes() == w.numel() * 4
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(packed_weights.BUDGET_ENV, bad)
        with pytest.raises(ConfigError, match=packed_weights.BUDGET_ENV):
            packed_weights.budget_bytes()
    monkeypatch.delenv(packed_weights.BUDGET_ENV)
    assert packed_weights.budget_bytes() > 0


def test_other_dtypes_take_f_linear():
    w, x = torch.randn(8, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    assert torch.equal(packed_weights.packed_product(x, w, None), F.linear(x, w))
    assert packed_weights.packed_bytes() == 0


def _timer(speeds: dict[str, float]):
    def timer(name, fn):
        fn()
        return speeds.get(name, 50.0)

    return timer


@pytest.mark.parametrize("packed_wins", [True, False])
def test_a_lone_products_trial_keeps_its_copy_only_when_chosen(monkeypatch, packed_wins):
    speeds = {"stock": 1.0, PACKED: 0.5 if packed_wins else 2.0}
    c = Chooser(timer=_timer(speeds), store=None, repeats=3)
    monkeypatch.setattr(products, "chooser", lambda: c)
    set_choice(monkeypatch, "products", "auto")
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(64, 16, generator=g), torch.randn(4, 16, generator=g)
    with torch.no_grad():
        products.linear_product(x, w)  # first sight
        products.linear_product(x, w)  # measured
    assert c.choices[products.shape_key(4, w, None)]["choice"] == (PACKED if packed_wins else "stock")
    assert packed_weights.packed_bytes() == (w.numel() * 4 if packed_wins else 0)


@pytest.mark.parametrize("packed_wins", [True, False])
def test_a_pass_groups_trial_releases_its_copies_unless_chosen(monkeypatch, packed_wins):
    """Every candidate runs whole steps (fake clock: each product advances it by its candidate's speed); the packed
    copies the trial made for the group's weights stay only when packed GEMM is chosen for that width."""
    now = [0.0]
    speeds = {"stock": 1.0, PACKED: 0.2 if packed_wins else 3.0}
    real = dict(products.CANDIDATES)
    for name in real:
        if name != "stock":
            monkeypatch.setitem(
                products.CANDIDATES,
                name,
                lambda x, w, b=None, name=name: (
                    now.__setitem__(0, now[0] + speeds.get(name, 50.0)) or real[name](x, w, b)
                ),
            )
    real_linear = F.linear
    monkeypatch.setattr(
        products.F, "linear", lambda *a: now.__setitem__(0, now[0] + speeds["stock"]) or real_linear(*a)
    )
    c = Chooser(timer=_timer({}), store=None, repeats=3, clock=lambda: now[0])
    monkeypatch.setattr(products, "chooser", lambda: c)
    set_choice(monkeypatch, "products", "auto")
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Linear(48, 16))
    route_linears(net)
    key = net[0]._pass_group.key(3, torch.float32)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(200):
            net(x)
            if key in c.choices:
                break
    assert c.choices[key]["choice"] == (PACKED if packed_wins else "stock")
    weights = sum(m.weight.numel() * 4 for m in (net[0], net[2]))
    assert packed_weights.packed_bytes() == (weights if packed_wins else 0)
