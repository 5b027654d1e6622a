"""A pass group's product choice timed in the real decoding steps (target/products.py, step_trial.py): whole steps
per candidate in turn, unclear trials extended, broken or stalled steps handled, one trial at a time, and the rest
of a pass taking its opening's settled choice. Injected clocks and timings: nothing is timed for real."""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.cpu_products import products
from dflashkit.cpu_products import report as product_report
from dflashkit.cpu_products.products import CANDIDATES, MAX_ROWS, Chooser, route_linears
from helpers.choices import set_choice
from helpers.product_fakes import clocked_candidates as _clocked_candidates
from helpers.product_fakes import fake_timer as _fake_timer
from helpers.product_fakes import use_chooser as _use

N = len(CANDIDATES)  # stock, few_rows, and onednn / mkl_packed where torch has them


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
    from dflashkit.cpu_products.step_trial import MAX_EXTENSIONS

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
    DFLASHKIT_CHOICES takes effect at the next pass, every product of a pass runs one path, and a width not settled
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
        set_choice(monkeypatch, "products", "stock")
        seen.clear()
        net(x)
        assert [n for n, _ in seen] == ["stock"] * 3 and group.this_pass[3] == "stock"
        set_choice(monkeypatch, "products", "auto")
        seen.clear()
        net(torch.randn(1, 5, 16))  # another width met for the first time: stock, and its pass not settled
        assert [n for n, _ in seen] == ["stock"] * 3 and group.this_pass is None
        seen.clear()
        net(x)
        assert [n for n, _ in seen] == ["few_rows"] * 3
