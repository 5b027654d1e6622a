"""serve-check --concurrency against servers on 127.0.0.1 (tests/helpers/fake_engine.py): each level sends
concurrency × rounds requests with that many in flight, reads throughput, latency and the server's counters over the
level, and names the level where the drafter stops paying against a baseline server of the same target."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from dflashkit.cli import main
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.export.concurrency import Level, LoadCurve, LoadSettings, load_curve
from dflashkit.export.served import ServedError
from helpers.bad_input import _one_line_error
from helpers.checkpoints import small_config, write_checkpoint
from helpers.fake_engine import FakeEngine

PROMPTS = [[1, 4, 9, 16, 25, 36, 49], [3, 5, 7, 11, 13], [2, 4, 8, 16, 32, 64]]


@pytest.fixture(scope="module")
def drafter():
    torch.manual_seed(0)
    d = DFlashDrafter(small_config(block_size=4))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0.0, 0.5)
    return d.eval()


def test_each_level_counts_its_requests_tokens_and_the_servers_counters(target, drafter):
    settings = LoadSettings(levels=(1, 2), max_new_tokens=6, rounds=2)
    with FakeEngine(target, drafter) as srv, FakeEngine(target, drafter, speculative=False) as base:
        curve = load_curve(srv.url, PROMPTS, settings, baseline=base.url)
        served = srv.requests
    one, two = curve.levels
    assert (one.concurrency, one.requests, two.requests) == (1, 3, 4)  # at least every prompt once
    assert one.tokens == 3 * 6 and two.tokens == 4 * 6 and served == 7
    assert len(one.latencies_s) == 3 and all(s > 0 for s in one.latencies_s)
    # the level's counter difference: drafts are rounds, one per token after the first unless accepted
    assert (
        one.drafts is not None
        and one.drafts + one.accepted == 3 * 5 + one.drafts - one.drafts + one.accepted - one.accepted
    )
    assert one.tau >= 1.0 and len(one.accepted_per_pos) == 3
    assert [b.drafts for b in curve.baseline_levels] == [None, None]  # no drafter: no acceptance claimed
    d = json.loads(json.dumps(curve.as_dict()))
    assert d["levels"][0]["tok_per_s"] > 0 and "latency_p90_s" in d["levels"][1]
    assert "load curve" in curve.render() and "conc." in curve.render()


def test_where_the_drafter_stops_paying_is_the_first_level_not_above_the_baseline():
    def level(c, tps):
        return Level(c, 4, int(tps * 10), 10.0, [1.0])

    curve = LoadCurve(
        "a", "b", 8, [level(1, 30), level(4, 50), level(16, 60)], [level(1, 20), level(4, 50), level(16, 80)]
    )
    assert curve.stops_paying() == 4
    assert "stops paying at concurrency 4" in curve.render()
    curve.baseline_levels = [level(1, 10), level(4, 10), level(16, 10)]
    assert curve.stops_paying() is None and "pays at every concurrency" in curve.render()


def test_requests_really_run_concurrently(target, drafter):
    """With 3 in flight the server sees 3 requests at once at some moment (the client does not serialise them)."""
    peak, live, lock = [0], [0], threading.Lock()
    with FakeEngine(target, drafter) as srv:
        real = srv._complete

        def slow(body):
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            time.sleep(0.2)
            try:
                return real(body)
            finally:
                with lock:
                    live[0] -= 1

        srv._complete = slow
        load_curve(srv.url, PROMPTS, LoadSettings(levels=(3,), max_new_tokens=2, rounds=1))
    assert peak[0] == 3


def test_cli_draws_the_curve_and_refuses_what_it_cannot_measure(tmp_path, target, drafter, tiny_llama_dir, capsys):
    ckpt = write_checkpoint(tmp_path / "d", small_config(block_size=4))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    base = [
        "serve-check",
        str(ckpt),
        "--target",
        str(tiny_llama_dir),
        "--dataset",
        str(prompts),
        "--max-new-tokens",
        "4",
    ]
    with FakeEngine(target, drafter) as srv, FakeEngine(target, drafter, speculative=False) as plain:
        rc = main([*base, "--server", srv.url, "--concurrency", "1,2", "--baseline-server", plain.url, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [x["concurrency"] for x in out["levels"]] == [1, 2] and len(out["baseline_levels"]) == 2
    assert "requests in flight" in _one_line_error(capsys, main([*base, "--server", srv.url, "--concurrency", "0"]))
    rc = main([*base, "--concurrency", "1,2"])  # no server, no engine to start
    assert "--concurrency needs --server" in _one_line_error(capsys, rc)
    rc = main([*base, "--server", srv.url, "--baseline-server", srv.url])
    assert "--baseline-server applies" in _one_line_error(capsys, rc)
    with pytest.raises(ServedError, match="no server answers"):
        from dflashkit.export.llama_server import free_port

        load_curve(f"http://127.0.0.1:{free_port()}", PROMPTS, LoadSettings(levels=(1,), max_new_tokens=2))
