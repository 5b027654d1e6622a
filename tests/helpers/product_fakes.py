"""Fakes for the product-choice tests (tests/target/test_products.py, test_pass_trials.py): a chooser installed for
one test, an injected timer, and candidates that advance a fake clock."""

import torch.nn.functional as F

from dflashkit.cpu_products import products
from dflashkit.cpu_products.products import CANDIDATES, Chooser
from helpers.choices import set_choice


def use_chooser(monkeypatch, chooser: Chooser) -> Chooser:
    """Make `chooser` the process's product chooser, in auto mode, for this test."""
    monkeypatch.setattr(products, "chooser", lambda: chooser)
    set_choice(monkeypatch, "products", "auto")
    return chooser


def fake_timer(speeds: dict[str, float], calls: list[str]):
    def timer(name, fn):
        fn()  # the candidate still runs: a broken candidate would fail here
        calls.append(name)
        return speeds.get(name, 50.0)  # a candidate not named is the slowest

    return timer


def clocked_candidates(mp, speeds: dict[str, float], now: list[float], seen: list[tuple[str, int]]):
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
