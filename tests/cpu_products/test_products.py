"""The products of a decoding step: every candidate equals F.linear within float32 rounding; the choice is made by
measurement (injected timings here: the faster candidate wins only beyond the noise, stock otherwise), kept for the
process and on disk, overridden by DFLASHKIT_CHOICES=products=…; fallbacks run F.linear exactly."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.cpu_products import products
from dflashkit.cpu_products import report as product_report
from dflashkit.cpu_products.products import CANDIDATES, MAX_ROWS, Chooser, linear_product, route_linears
from dflashkit.errors import ConfigError
from helpers.choices import set_choice
from helpers.product_fakes import fake_timer as _fake_timer
from helpers.product_fakes import use_chooser as _use

N = len(CANDIDATES)  # stock, few_rows, and onednn where torch has it


def _bound(x, w):
    # float32 dot products of length H in any summation order: |error| ≤ H·eps·Σ|x_i w_i| (loose, never flaky)
    return x.shape[-1] * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t())


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_every_candidate_equals_f_linear_within_rounding(name):
    """…and returns a row-major tensor, as F.linear does (a transposed view slowed every later op)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(3000, 64, generator=g), torch.randn(3000, generator=g)
    for rows in (1, 2, 3, 5, 9, 16, 17, 32, MAX_ROWS):
        x = torch.randn(rows, 64, generator=g)
        got = CANDIDATES[name](x, w, None)
        assert got.shape == (rows, 3000) and ((got - F.linear(x, w)).abs() <= _bound(x, w)).all(), rows
        assert got.is_contiguous(), rows
        got_b = CANDIDATES[name](x, w, b)
        assert ((got_b - F.linear(x, w, b)).abs() <= _bound(x, w) + 1e-6 * b.abs()).all(), rows


def test_chooser_measures_once_per_shape_keeps_it_on_disk_and_reloads(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 32, generator=g)
    x2, x5 = torch.randn(2, 32, generator=g), torch.randn(5, 32, generator=g)
    calls: list[str] = []
    store = tmp_path / "products.json"
    c = Chooser(timer=_fake_timer({"stock": 1.0, "few_rows": 0.5}, calls), store=store, repeats=3)
    assert c.choose(x2, w, None) == "stock" and calls == []  # first sight: stock, unmeasured (a one-off prefill)
    assert c.choose(x2, w, None) == "few_rows" and len(calls) == 3 * N  # 3 interleaved rounds × every candidate
    assert calls[: 2 * N] == [*CANDIDATES, *reversed(CANDIDATES)]  # ABBA order
    assert c.choose(x2, w, None) == "few_rows" and len(calls) == 3 * N  # kept for the process
    c.timer = _fake_timer({"stock": 0.5, "few_rows": 1.0}, calls)
    c.choose(x5, w, None)
    assert c.choose(x5, w, None) == "stock" and len(calls) == 6 * N  # another shape, another measurement
    saved = json.loads(store.read_text())
    assert set(saved["choices"]) == {"2x32x300:float32", "5x32x300:float32"} and "cpu" in saved["machine"]
    again = Chooser(timer=_fake_timer({"stock": 9.0, "few_rows": 0.1}, calls := []), store=store)
    assert again.choose(x2, w, None) == "few_rows" and again.choose(x5, w, None) == "stock" and calls == []
    store.write_text("{not json")
    damaged = Chooser(timer=_fake_timer({"stock": 0.2, "few_rows": 1.0}, calls), store=store)
    damaged.choose(x2, w, None)
    assert damaged.choose(x2, w, None) == "stock" and calls  # re-measured, not trusted


def test_the_override_and_the_fallbacks(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(500, 32, generator=g)
    x = torch.randn(1, 4, 32, generator=g)
    set_choice(monkeypatch, "products", "stock")
    assert torch.equal(linear_product(x, w), F.linear(x, w))
    set_choice(monkeypatch, "products", "few_rows")
    assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x.reshape(4, 32), w, None).reshape(1, 4, 500))
    set_choice(monkeypatch, "products", "fastest")
    with pytest.raises(
        ConfigError, match="DFLASHKIT_CHOICES: products='fastest': expected one of auto, stock, few_rows, onednn"
    ):
        linear_product(x, w)
    set_choice(monkeypatch, "products", "few_rows")
    long = torch.randn(MAX_ROWS + 1, 32, generator=g)  # a prefill: stock
    assert torch.equal(linear_product(long, w), F.linear(long, w))
    with products.stock_products():
        assert torch.equal(linear_product(x, w), F.linear(x, w))
    xg = torch.randn(4, 32, generator=g, requires_grad=True)  # training keeps autograd's path
    out = linear_product(xg, w)
    assert torch.equal(out, F.linear(xg, w)) and out.requires_grad
    with torch.no_grad(), pytest.raises(RuntimeError):  # dtype mismatch: F.linear's own error
        linear_product(torch.randn(3, 32, generator=g).double(), w)
    assert linear_product(torch.zeros(0, 32), w).shape == (0, 500)


def test_auto_mode_runs_the_chosen_candidate(monkeypatch):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 16, generator=g)
    x = torch.randn(3, 16, generator=g)
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({"stock": 1.0, "few_rows": 0.1}, []), store=None, repeats=3))
    assert torch.equal(linear_product(x, w), F.linear(x, w))  # first sight: stock
    assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x, w, None))
    assert product_report.choices_by_rows({"choices": fake.choices}) == {3: {"few_rows": 1}}


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
    # the head module (HF generate calls it) is routed as a lone product, the layers as one pass group
    assert target.lm_head._routed and target.lm_head._pass_group is None
    assert target.layers[0].mlp.up_proj._pass_group is not None
    h = torch.randn(1, 4, target.hidden_size)
    got = target.verifier_logits(h)
    with torch.no_grad():
        ref = F.linear(target.final_norm(h), target.lm_head.weight)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_a_pass_without_a_cache_is_never_measured(tiny_llama_dir, monkeypatch, tmp_path):
    """A forward without a cache (capture, features, checks) is a one-off over whole sequences: two samples of the
    same short length (the quickstart's capture met 42 and 57 tokens twice and timed them as decoding widths)
    take stock products; a decoding step with a cache is still measured at its second sight."""
    from dflashkit.target.model import Target

    calls: list[str] = []
    fake = _use(
        monkeypatch,
        Chooser(timer=_fake_timer({"stock": 1.0, "few_rows": 0.2}, calls), store=tmp_path / "c.json", repeats=1),
    )
    target = Target.load(str(tiny_llama_dir))
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 8]])  # 7 rows, within MAX_ROWS
    with torch.no_grad():
        first = target.forward(ids, layer_ids=[1]).logits
        for _ in range(3):
            assert torch.equal(target.forward(ids, layer_ids=[1]).logits, first)
        assert calls == [] and fake.choices == {}
        cache = target.new_cache()
        target.forward(ids[:, :3], cache=cache, use_cache=True)
        for t in range(3, 6):  # one-row decoding steps with the cache: the second one is measured
            target.forward(ids[:, t : t + 1], cache=cache, use_cache=True)
    assert calls and all(k.startswith("1x") for k in fake.choices), sorted(fake.choices)


def test_a_settled_choice_is_looked_up_and_follows_the_variable(monkeypatch):
    """A decoding step's ~200 products skip the chooser once a shape's choice is settled (measured or forced);
    unsettled calls (first sight, fallbacks) ask again, and a changed DFLASHKIT_CHOICES takes effect at once."""
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(40, 8, generator=g), torch.randn(2, 8, generator=g)
    fake = Chooser(timer=_fake_timer({"stock": 1.0, "few_rows": 0.2}, []), store=None, repeats=3)
    asked: list[str] = []
    choose = fake.choose
    monkeypatch.setattr(fake, "choose", lambda *a: asked.append("choose") or choose(*a))
    _use(monkeypatch, fake)
    with torch.no_grad():
        assert torch.equal(linear_product(x, w), F.linear(x, w))  # first sight: stock, not settled
        assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x, w, None))  # measured: settled
        for _ in range(3):
            assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x, w, None))
        assert asked == ["choose", "choose"]
        set_choice(monkeypatch, "products", "stock")
        assert torch.equal(linear_product(x, w), F.linear(x, w))
        set_choice(monkeypatch, "products", "auto")
        assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x, w, None))
    assert asked == ["choose", "choose"]


def test_the_cold_timer_works_in_and_out_of_inference_mode(monkeypatch):
    # Regeneration decodes under inference_mode; a later measurement outside it (a verify pass under no_grad) used
    # the same eviction buffer — created as an inference tensor, its in-place update raised there.
    monkeypatch.setattr(products.SPEED, "scratch", None)
    monkeypatch.setattr(products, "last_level_cache_bytes", lambda: 1 << 20)
    with torch.inference_mode():
        assert products._cold_timer("stock", lambda: None) >= 0
    with torch.no_grad():
        assert products._cold_timer("stock", lambda: None) >= 0
    assert products._cold_timer("few_rows", lambda: None) >= 0


def test_a_candidate_this_build_cannot_run_drops_out_and_is_not_retried(tmp_path):
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(64, 16, generator=g), torch.randn(2, 16, generator=g)

    def broken(x, w, b):
        raise RuntimeError("no kernel for this shape")

    calls: list[str] = []
    store = tmp_path / "c.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CANDIDATES, "onednn", broken)
        c = Chooser(timer=_fake_timer({"stock": 1.0, "few_rows": 0.5, "onednn": 0.1}, calls), store=store, repeats=3)
        c.choose(x, w, None)
        assert c.choose(x, w, None) == "few_rows" and "onednn" not in calls and len(calls) == 3 * (N - 1)
        entry = json.loads(store.read_text())["choices"]["2x16x64:float32"]
        assert entry["onednn_ms"] is None and entry["choice"] == "few_rows"
        again = Chooser(timer=_fake_timer({}, calls := []), store=store)
        assert again.choose(x, w, None) == "few_rows" and calls == []  # from the store: not measured again
        mp.setitem(CANDIDATES, "stock", broken)
        with pytest.raises(RuntimeError, match="no kernel"):  # stock itself failing is a real error, never hidden
            Chooser(timer=_fake_timer({}, []), store=None).measure(x, w, None)


def test_a_store_measured_before_a_candidate_joined_is_measured_again(tmp_path):
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(64, 16, generator=g), torch.randn(2, 16, generator=g)
    store = tmp_path / "c.json"
    old = {"choice": "few_rows", "stock_ms": 1.0, "few_rows_ms": 0.5, "noise": 0.03}  # no "onednn_ms"
    store.write_text(json.dumps({"choices": {"2x16x64:float32": old}}))
    calls: list[str] = []
    c = Chooser(timer=_fake_timer({"stock": 1.0, "few_rows": 0.5, "onednn": 0.2}, calls), store=store, repeats=3)
    c.choose(x, w, None)  # the old entry is not trusted: first sight again (stock), then measured
    expected = "onednn" if "onednn" in CANDIDATES else "few_rows"
    assert c.choose(x, w, None) == expected and len(calls) == 3 * N


@pytest.mark.skipif("onednn" not in CANDIDATES, reason="this torch build has no oneDNN")
def test_the_onednn_override_runs_onednn():
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(300, 32, generator=g), torch.randn(1, 3, 32, generator=g)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        set_choice(mp, "products", "onednn")
        got = linear_product(x, w)
        assert torch.equal(got, CANDIDATES["onednn"](x.reshape(3, 32), w, None).reshape(1, 3, 300))
        assert ((got - F.linear(x, w)).abs() <= _bound(x, w)).all()
        mp.delitem(CANDIDATES, "onednn")  # a build without oneDNN: forcing it is refused by name
        with pytest.raises(ConfigError, match="DFLASHKIT_CHOICES: products=onednn: this torch build has no oneDNN"):
            products.mode()
    assert products.PRODUCTS.override() != "onednn"
