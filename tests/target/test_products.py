"""The products of a decoding step: every candidate equals F.linear within float32 rounding; the choice is made by
measurement (injected timings here: the faster candidate wins only beyond the noise, stock otherwise), kept for the
process and on disk, overridden by DFLASHKIT_PRODUCTS; fallbacks run F.linear exactly."""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.errors import ConfigError
from dflashkit.target import product_report, products
from dflashkit.target.products import CANDIDATES, MAX_ROWS, Chooser, linear_product, route_linears

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


def _use(monkeypatch, chooser: Chooser) -> Chooser:
    """Make `chooser` the process's product chooser, in auto mode, for this test."""
    monkeypatch.setattr(products, "chooser", lambda: chooser)
    monkeypatch.setenv(products.ENV, "auto")
    return chooser


def _fake_timer(speeds: dict[str, float], calls: list[str]):
    def timer(name, fn):
        fn()  # the candidate still runs: a broken candidate would fail here
        calls.append(name)
        return speeds.get(name, 50.0)  # a candidate not named is the slowest

    return timer


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
    monkeypatch.setenv(products.ENV, "stock")
    assert torch.equal(linear_product(x, w), F.linear(x, w))
    monkeypatch.setenv(products.ENV, "few_rows")
    assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x.reshape(4, 32), w, None).reshape(1, 4, 500))
    monkeypatch.setenv(products.ENV, "fastest")
    with pytest.raises(
        ConfigError, match="DFLASHKIT_PRODUCTS='fastest': expected one of auto, stock, few_rows, onednn"
    ):
        linear_product(x, w)
    monkeypatch.setenv(products.ENV, "few_rows")
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


def _clocked_candidates(mp, speeds: dict[str, float], now: list[float], seen: list[tuple[str, int]]):
    """Every candidate advances a fake clock by its speed per product call and logs (name, out features); stock is
    F.linear itself (linear_product calls it directly)."""
    real = {**CANDIDATES, "stock": F.linear}

    def clocked(name):
        def fn(x, w, b=None):
            now[0] += speeds.get(name, 50.0)
            seen.append((name, w.shape[0]))
            return real[name](x, w, b)

        return fn

    for name in CANDIDATES:
        if name != "stock":
            mp.setitem(CANDIDATES, name, clocked(name))
    mp.setattr(products.F, "linear", clocked("stock"))


def test_a_pass_group_is_chosen_by_timing_real_steps(monkeypatch, tmp_path):
    """From the second step at a row count, each candidate runs whole steps in turn (ABBA) and the step — from one
    opening of the pass to the next — is timed; every product of a step runs the step's candidate; after `repeats`
    steps each, the faster is kept for the process and on disk."""
    torch.manual_seed(4)
    net = nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Linear(48, 16, bias=False), nn.Linear(16, 8))
    assert route_linears(net) == 3
    group = net[0]._pass_group
    assert len({id(m._pass_group) for m in net if isinstance(m, nn.Linear)}) == 1 and group.signature.startswith(
        "pass3-"
    )
    now, seen = [0.0], []
    fake = _use(
        monkeypatch, Chooser(timer=_fake_timer({}, []), store=tmp_path / "c.json", repeats=3, clock=lambda: now[0])
    )
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = F.linear(F.linear(F.silu(F.linear(x, net[0].weight, net[0].bias)), net[2].weight), net[3].weight)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {"stock": 1.0, "few_rows": 0.2}, now, seen)
        for _ in range(1 + 3 * N):  # first sight (stock, untimed), then 3 N steps of the trial
            torch.testing.assert_close(net(x), ref + net[3].bias, rtol=1e-5, atol=1e-6)
        assert f"2x{group.signature}:float32" not in fake.choices  # the last trial step ends at the next opening
        assert [n for n, _ in seen[3 : 3 + N]] == list(CANDIDATES)  # each candidate tried once on the first product
        steps = [seen[i : i + 3] for i in range(3 + N, len(seen), 3)]
        assert all(len({name for name, _ in s}) == 1 for s in steps)  # a step's products all run its candidate
        assert [s[0][0] for s in steps] == [*CANDIDATES, *reversed(CANDIDATES), *CANDIDATES]  # ABBA, whole steps
        net(x)
        assert [n for n, _ in seen[-3:]] == ["few_rows"] * 3  # decided at this opening: it runs the choice
    entry = fake.choices[f"2x{group.signature}:float32"]
    assert entry["choice"] == "few_rows" and entry["timed"] == "steps"
    assert (entry["stock_ms"], entry["few_rows_ms"]) == (3000.0, 600.0)  # 3 products a step
    assert json.loads((tmp_path / "c.json").read_text())["choices"][f"2x{group.signature}:float32"] == entry
    assert product_report.choices_by_rows({"choices": fake.choices}) == {2: {"few_rows": 1}}


def _trial_with_lost_rounds(monkeypatch, lost: set[int], repeats: int = 4) -> tuple[str, int]:
    """A one-linear pass group timed in steps of a fake clock: stock 1.0 a step, few_rows 0.8 except in its
    `lost` rounds (1.2), any other candidate 2.0. Returns the choice and how many few_rows steps ran."""
    net = nn.Linear(8, 8)
    route_linears(net)
    key = f"2x{net._pass_group.signature}:float32"
    now, seen, ran = [0.0], [], [0]
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=repeats, clock=lambda: now[0]))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, dict.fromkeys([*CANDIDATES, "stock"], 0.0), now, seen)
        for _ in range(400):
            if key in fake.choices:
                break
            seen.clear()
            net(torch.randn(2, 8))
            name = seen[0][0]
            if name == "few_rows":
                now[0] += 1.2 if ran[0] in lost else 0.8
                ran[0] += 1
            else:
                now[0] += 1.0 if name == "stock" else 2.0
    return str(fake.choices[key]["choice"]), ran[0]


@pytest.mark.parametrize(
    ("lost", "choice", "few_rows_steps"),
    [
        (set(), "few_rows", 4),  # clear after the first rounds
        ({0}, "few_rows", 8),  # lost one round of four: unclear, four more rounds, then clear
        ({0, 4, 8}, "stock", 12),  # still losing a round in four after the extensions: stock
        (set(range(99)), "stock", 4),  # slower: stock at once, no extension
    ],
)
def test_an_unclear_trial_is_timed_further_before_stock_is_kept(monkeypatch, lost, choice, few_rows_steps):
    """A candidate ahead of stock in the median that lost a round too many is timed for more rounds (up to
    MAX_EXTENSIONS sets) instead of keeping stock at once: one noisy round must not cost a verify width its faster
    product for good (on the EPYC VM a 4-row verify kept stock, 1.16× slower, and chain ran at 0.71× of AR)."""
    from dflashkit.target.step_trial import MAX_EXTENSIONS

    assert MAX_EXTENSIONS == 2
    got, ran = _trial_with_lost_rounds(monkeypatch, lost)
    assert got == choice
    assert ran in (few_rows_steps, few_rows_steps + 1)  # (+ the step after the verdict, which runs the choice)


def test_a_step_with_something_else_inside_is_not_timed(monkeypatch):
    """A prefill, a stock block or a pass at another row count between two openings: that interval is not a step,
    so it is not recorded and the same candidate runs the next step again."""
    net = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8))
    route_linears(net)
    now, seen = [0.0], []
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=1, clock=lambda: now[0]))
    x2, x3, long = torch.randn(2, 8), torch.randn(3, 8), torch.randn(MAX_ROWS + 1, 8)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {"stock": 1.0, "few_rows": 2.0}, now, seen)
        net(x2), net(x2)  # first sight, then the trial's first step opens (stock)
        trial = fake._trials[f"2x{net[0]._pass_group.signature}:float32"]
        for between in ("prefill", "another width", "stock block"):
            if between == "prefill":
                net(long)
            elif between == "another width":
                net(x3)
            with products.stock_products() if between == "stock block" else contextlib.nullcontext():
                pass
            net(x2)  # not recorded: something came between the openings
            assert trial.pos == 0 and trial.times["stock"] == [], between
        net(x2)
        assert trial.pos == 1 and trial.times["stock"] == [2.0]  # an unbroken step: two products of speed 1


def test_a_candidate_that_cannot_run_is_left_out_of_the_steps(monkeypatch):
    def broken(x, w, b):
        raise RuntimeError("no kernel")

    net = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8))
    route_linears(net)
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=1, clock=iter(range(100)).__next__))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setitem(CANDIDATES, "onednn", broken)
        for _ in range(2 + (N - 1)):
            net(torch.randn(2, 8))
        entry = fake.choices[f"2x{net[0]._pass_group.signature}:float32"]
    assert entry["onednn_ms"] is None and entry["timed"] == "steps" and entry["choice"] in ("stock", "few_rows")


def test_a_settled_choice_is_looked_up_and_follows_the_variable(monkeypatch):
    """A decoding step's ~200 products skip the chooser once a shape's choice is settled (measured or forced);
    unsettled calls (first sight, fallbacks) ask again, and a changed DFLASHKIT_PRODUCTS takes effect at once."""
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
        monkeypatch.setenv(products.ENV, "stock")
        assert torch.equal(linear_product(x, w), F.linear(x, w))
        monkeypatch.setenv(products.ENV, "auto")
        assert torch.equal(linear_product(x, w), CANDIDATES["few_rows"](x, w, None))
    assert asked == ["choose", "choose"]


def test_the_cold_timer_works_in_and_out_of_inference_mode(monkeypatch):
    # Regeneration decodes under inference_mode; a later measurement outside it (a verify pass under no_grad) used
    # the same eviction buffer — created as an inference tensor, its in-place update raised there.
    monkeypatch.setattr(products, "_SCRATCH", [])
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
    import os

    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(300, 32, generator=g), torch.randn(1, 3, 32, generator=g)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setenv(products.ENV, "onednn")
        got = linear_product(x, w)
        assert torch.equal(got, CANDIDATES["onednn"](x.reshape(3, 32), w, None).reshape(1, 3, 300))
        assert ((got - F.linear(x, w)).abs() <= _bound(x, w)).all()
        mp.delitem(CANDIDATES, "onednn")  # a build without oneDNN: forcing it is refused by name
        with pytest.raises(ConfigError, match="DFLASHKIT_PRODUCTS=onednn: this torch build has no oneDNN"):
            products.mode()
    assert os.environ.get(products.ENV) != "onednn"


def test_two_groups_in_one_loop_are_timed_one_after_the_other(monkeypatch):
    """A drafter's layers and the target's both run in every speculative round: timed at once, their candidates
    would change in lockstep and each group's step times would carry the other's choice. One trial runs at a time
    (the other group runs stock meanwhile), and the other group's pass inside a round does not break its steps."""
    torch.manual_seed(5)
    target, drafter = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8)), nn.Sequential(nn.Linear(8, 16))
    route_linears(target), route_linears(drafter)
    now, seen = [0.0], []
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=1, clock=lambda: now[0]))
    x = torch.randn(3, 8)
    keys = [f"3x{m[0]._pass_group.signature}:float32" for m in (target, drafter)]
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {"stock": 1.0, "few_rows": 0.5}, now, seen)
        rounds = 0
        while not all(k in fake.choices for k in keys) and rounds < 40:
            drafter(x), target(x)  # one speculative round: draft, then verify
            rounds += 1
            assert len(fake._trials) <= 1
    assert all(fake.choices[k]["choice"] == "few_rows" and fake.choices[k]["timed"] == "steps" for k in keys)
    assert rounds <= 2 + 2 * (N + 1) + 1  # first sight, then each group's N steps (+ the closing opening) in turn


def test_a_trial_that_stalls_is_paused_lets_the_others_run_and_resumes(monkeypatch):
    """A width met only now and then (a tree's width in a benchmark that runs one method after another) starts a
    trial that stops making progress: after 2 × its schedule's openings without a recorded step it is paused (stock
    meanwhile), the widths that recur get their trials, and it resumes — at the start of its round, the round's
    steps timed again — when its width opens with no trial running."""
    net = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8))
    route_linears(net)
    now = [0.0]
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=2, clock=lambda: now[0]))
    sometimes, common = torch.randn(3, 8), torch.randn(2, 8)
    key3, key2 = (f"{r}x{net[0]._pass_group.signature}:float32" for r in (3, 2))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {"stock": 1.0, "few_rows": 0.5}, now, [])
        net(sometimes), net(common), net(sometimes), net(sometimes)  # its trial starts, then records one step
        trial = fake._trials[key3]
        assert trial.pos == 1 and trial.times["stock"] == [2.0]
        for _ in range(4 * N + 1):  # the common width waits (stock) while the trial makes no progress
            net(common)
        assert key3 not in fake._trials and fake._paused[key3] is trial and key3 not in fake._rare
        assert trial.pos == 0 and trial.times["stock"] == []  # back to its round's start
        for _ in range(2 * N + 2):
            net(common)
        assert fake.choices[key2]["choice"] == "few_rows"
        for _ in range(2 * N + 1):
            net(sometimes)
        assert fake.choices[key3]["choice"] == "few_rows" and not fake._paused  # resumed and finished


def test_a_trial_whose_steps_are_always_broken_ends_in_stock(monkeypatch):
    """Openings of one width with another width in between every time: no step is ever recorded; each trial is
    paused after 2 × its schedule's openings, resumed, paused again, and given up after MAX_PAUSES: the widths run
    stock — never a trial's candidate for good."""
    net = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8))
    route_linears(net)
    seen: list[tuple[str, int]] = []
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=1, clock=lambda: 0.0))
    a, b = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {}, [0.0], seen)
        for _ in range(2 * products.MAX_PAUSES * (2 * N + 2)):
            net(a), net(b)  # each width's step has the other inside
        assert not fake._trials and not fake._paused and fake.choices == {} and len(fake._rare) == 2
        seen.clear()
        net(a), net(b)
    assert [n for n, _ in seen] == ["stock"] * 4


def test_a_width_that_stops_coming_is_paused_while_settled_widths_run(monkeypatch):
    """A width met once more after the others settled (a chain's 2-row verify at the end of a generation) starts a
    trial; when only settled widths follow, their openings count: after 2 × its schedule's openings without a step it
    is paused, so `trials_pending` (an evaluation's warm-up waits on it) turns False instead of staying True for the
    whole process (seen: a 2-row trial at step 0 of 28 through six passes of AR, chain and DDTree-3)."""
    net = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 8))
    route_linears(net)
    now = [0.0]
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=1, clock=lambda: now[0]))
    rare, common = torch.randn(2, 8), torch.randn(4, 8)
    key2, key4 = (f"{r}x{net[0]._pass_group.signature}:float32" for r in (2, 4))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {"stock": 1.0, "few_rows": 0.5}, now, [])
        for _ in range(2 * N + 2):
            net(common)
        assert key4 in fake.choices and not product_report.trials_pending()
        net(rare), net(common), net(rare)  # seen once, then again: its trial starts
        assert key2 in fake._trials and product_report.trials_pending()
        schedule = len(fake._trials[key2].schedule)
        for _ in range(2 * schedule + 1):
            net(common)  # settled: no step of the 2-row trial in between
        assert not product_report.trials_pending() and key2 in fake._paused and key2 not in fake._trials
        net(rare), net(rare)  # when it comes again with no trial running, it resumes
        assert key2 in fake._trials


def test_the_rest_of_a_pass_takes_its_openings_settled_choice(monkeypatch):
    """A pass group's other products skip the lookup when the pass's opening found its width settled; a forced
    DFLASHKIT_PRODUCTS takes effect at the next pass, every product of a pass runs one path, and a width not settled
    (a trial under way) leaves the rest of the pass to the chooser."""
    torch.manual_seed(7)
    net = nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Linear(48, 16, bias=False), nn.Linear(16, 8))
    route_linears(net)
    group = net[0]._pass_group
    now, seen = [0.0], []
    fake = _use(monkeypatch, Chooser(timer=_fake_timer({}, []), store=None, repeats=3, clock=lambda: now[0]))
    x = torch.randn(1, 2, 16)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        _clocked_candidates(mp, {"stock": 1.0, "few_rows": 0.2}, now, seen)
        net(x)  # first sight: stock, not settled
        assert group.this_pass is None
        net(x)  # a trial opens: not settled either
        assert group.this_pass is None
        looked_up: list[int] = []
        real = products._settled_or_chosen
        mp.setattr(products, "_settled_or_chosen", lambda *a: looked_up.append(1) or real(*a))
        while f"2x{group.signature}:float32" not in fake.choices:
            net(x)
        seen.clear()
        looked_up.clear()
        for _ in range(3):
            net(x)
        assert group.this_pass == ((1, 2), torch.float32, True, "few_rows")
        assert [n for n, _ in seen] == ["few_rows"] * 9 and len(looked_up) == 3  # one lookup a pass: its opening
        monkeypatch.setenv(products.ENV, "stock")
        seen.clear()
        net(x)
        assert [n for n, _ in seen] == ["stock"] * 3 and group.this_pass[3] == "stock"
        monkeypatch.setenv(products.ENV, "auto")
        seen.clear()
        net(torch.randn(1, 5, 16))  # another width met for the first time: stock, and its pass not settled
        assert [n for n, _ in seen] == ["stock"] * 3 and group.this_pass is None
        seen.clear()
        net(x)
        assert [n for n, _ in seen] == ["few_rows"] * 3
