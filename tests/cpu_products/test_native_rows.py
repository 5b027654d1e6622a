"""The few-row kernel compiled for this CPU (target/native_rows.py): equal to F.linear within float32 rounding on
every shape a tile boundary can cut, NaN and infinities as in any product, the same values at any thread count and
whatever the other rows, F.linear for what it does not take — and, where it cannot be built, a candidate the chooser
records unusable with the reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.cpu_products import native_rows, products
from dflashkit.cpu_products.products import NATIVE, Chooser, route_linears
from dflashkit.errors import ConfigError
from helpers.choices import set_choice

needs_kernel = pytest.mark.skipif(not native_rows.enabled(), reason="no C++ compiler here")


def _bound(x, w):
    return x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t())  # any summation order


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 17, 33, 64])
def test_equal_to_f_linear_within_rounding(rows):
    g = torch.Generator().manual_seed(rows)
    for inner, outer in ((1, 1), (5, 3), (16, 4), (17, 9), (31, 7), (32, 8), (48, 17), (64, 130), (577, 13)):
        x, w = torch.randn(rows, inner, generator=g), torch.randn(outer, inner, generator=g)
        b = torch.randn(outer + 1, generator=g)[1:]  # a bias 4 bytes off any vector alignment
        ref = (x.double() @ w.double().t()).float()  # float64 reference, rounded once
        for bias in (None, b):
            got = native_rows.native_product(x, w, bias)
            want = ref + bias if bias is not None else ref
            assert got.shape == (rows, outer) and got.is_contiguous() and got.dtype == torch.float32
            assert ((got - want).abs() <= _bound(x, w) + 1e-6 * want.abs()).all(), (rows, inner, outer)
            assert ((F.linear(x, w, bias) - want).abs() <= _bound(x, w) + 1e-6 * want.abs()).all()


@needs_kernel
def test_a_rows_values_do_not_depend_on_the_other_rows():
    """Every row count takes other register tiles (1 × 8 … 6 × 4, with rests), yet each output is summed in the same
    order: a row's values are bit-equal whether it is multiplied alone or with 1–17 others (a verify pass's logits
    do not depend on its width)."""
    g = torch.Generator().manual_seed(3)
    for inner, outer in ((576, 200), (577, 35), (64, 12), (40, 13)):
        w, b = torch.randn(outer, inner, generator=g), torch.randn(outer, generator=g)
        for rows in range(1, 18):
            x = torch.randn(rows, inner, generator=g)
            alone = torch.cat([native_rows.native_product(x[i : i + 1].clone(), w, b) for i in range(rows)])
            assert torch.equal(native_rows.native_product(x, w, b), alone), (inner, outer, rows)


@needs_kernel
def test_same_values_at_any_thread_count_and_for_any_layout():
    """Each output is one thread's dot product in a fixed order: bit-equal at 1 and 2 threads, and for a strided x."""
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(5, 96, generator=g), torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_rows.native_product(x, w, b)
        torch.set_num_threads(2)
        two = native_rows.native_product(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    strided = torch.randn(96, 5, generator=g).t()  # (5, 96), not contiguous
    assert torch.equal(
        native_rows.native_product(strided, w, b), native_rows.native_product(strided.contiguous(), w, b)
    )


@needs_kernel
def test_nan_and_infinity_propagate_row_by_row():
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(3, 40, generator=g), torch.randn(9, 40, generator=g)
    x[1, 7] = float("nan")
    x[2, 39] = float("inf")  # in the tail past the last full vector when the vector width does not divide 40
    got = native_rows.native_product(x, w, None)
    assert torch.isnan(got[1]).all() and torch.isfinite(got[0]).all()
    assert torch.equal(torch.isinf(got[2]), torch.isinf(F.linear(x, w)[2]))
    assert torch.isinf(got[2]).any()


@needs_kernel
def test_what_it_does_not_take_runs_f_linear():
    g = torch.Generator().manual_seed(9)
    w64, x64 = torch.randn(8, 4, dtype=torch.float64, generator=g), torch.randn(2, 4, dtype=torch.float64, generator=g)
    assert torch.equal(native_rows.native_product(x64, w64, None), F.linear(x64, w64))
    w = torch.randn(8, 4, generator=g).t()  # a strided (4, 8) weight
    x = torch.randn(2, 8, generator=g)
    assert torch.equal(native_rows.native_product(x, w, None), F.linear(x, w))
    with pytest.raises(RuntimeError):  # shapes that do not fit: torch's own error, the kernel never reads past x
        native_rows.native_product(torch.randn(2, 5), torch.randn(3, 8), None)


@needs_kernel
def test_built_once_into_the_user_cache_under_a_name_of_what_it_depends_on(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    native_rows.reset()
    try:
        info = native_rows.status()
        assert info["available"] and info["reason"] is None
        built = list((tmp_path / "kernels").glob("rows_linear-*.so"))
        assert [str(p) for p in built] == [info["library"]]  # no temporary file left beside it
        stamp = built[0].stat().st_mtime_ns
        native_rows.reset()
        assert native_rows.status()["library"] == info["library"] and built[0].stat().st_mtime_ns == stamp  # reused
        cxx = native_rows._compiler()
        monkeypatch.setattr(native_rows, "_compiler_version", lambda _c: "another compiler 1.0")
        assert native_rows.library_path(cxx) != built[0]  # another compiler builds its own
    finally:
        native_rows.reset()


def test_without_a_working_compiler_it_is_unusable_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails every build
    native_rows.reset()
    try:
        info = native_rows.status()
        assert not info["available"] and "failed" in info["reason"] and "false" in info["reason"]
        with pytest.raises(RuntimeError, match="failed"):
            native_rows.native_product(torch.randn(2, 4), torch.randn(3, 4), None)
        monkeypatch.setitem(products.CANDIDATES, NATIVE, native_rows.native_product)
        set_choice(monkeypatch, "products", NATIVE)
        with pytest.raises(ConfigError, match="cannot be had here"):
            products.mode()
        set_choice(monkeypatch, "products", "auto")
        c = Chooser(timer=lambda name, fn: (fn(), 1.0)[1], store=None, repeats=3)
        x, w = torch.randn(2, 16), torch.randn(8, 16)
        entry = c.measure(x, w, None)
        assert entry[f"{NATIVE}_ms"] is None and entry["choice"] != NATIVE  # tried and unusable: never chosen
    finally:
        native_rows.reset()


@needs_kernel
def test_a_cache_that_cannot_be_written_makes_it_unusable_not_an_error(monkeypatch, tmp_path):
    (tmp_path / "blocked").write_text("a file where the cache directory should be")
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "blocked"))
    native_rows.reset()
    try:
        info = native_rows.status()
        assert not info["available"] and "cannot build the kernel in the user cache" in info["reason"]
    finally:
        native_rows.reset()


def test_off_leaves_it_out(monkeypatch):
    set_choice(monkeypatch, "native", "off")
    assert not native_rows.enabled()
    native_rows.reset()
    try:
        assert native_rows.status() == {"available": False, "library": None, "reason": "native=off (DFLASHKIT_CHOICES)"}
    finally:
        native_rows.reset()


@needs_kernel
def test_a_forced_run_decodes_a_routed_model_as_stock_does(monkeypatch):
    """products=native_rows on a routed model: every product of a few rows through the kernel, outputs
    within rounding of the stock run."""
    torch.manual_seed(10)
    net = nn.Sequential(nn.Linear(24, 40), nn.SiLU(), nn.Linear(40, 24))
    route_linears(net)
    x = torch.randn(1, 4, 24)
    calls = []
    real = products.CANDIDATES[NATIVE]
    monkeypatch.setitem(products.CANDIDATES, NATIVE, lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        set_choice(monkeypatch, "products", "stock")
        want = net(x)
        set_choice(monkeypatch, "products", NATIVE)
        got = net(x)
    assert calls == [(4, 24), (4, 40)]  # both products, as (rows, in)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
