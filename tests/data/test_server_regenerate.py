"""Regeneration through OpenAI-compatible servers, against a small HTTP server on 127.0.0.1 that generates with the
tiny target (tests/helpers/fake_server.py): the same lines as in-process regeneration, both protocols, text-only
answers, retries, failover, clear errors, and no line lost or duplicated across a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflashkit.data.conversations import Conversation, encode_prompt
from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate
from dflashkit.data.server_client import ServerError, ServerPool, ServerTimeouts
from dflashkit.target.model import TargetText
from tests.helpers.fake_server import FakeServer

QUESTIONS = ["Hi", "Tell me a long story about dragons.", "What is 2+2?", "Name three colours.", "Why?", "ok"]


def _convs(n: int = len(QUESTIONS)) -> list[Conversation]:
    return [
        Conversation(
            [
                {"role": "user", "content": q},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": f"And more on {q}?"},
                {"role": "assistant", "content": "old 2"},
            ],
            f"c{i}",
            "test",
        )
        for i, q in enumerate(QUESTIONS[:n])
    ]


def _pool(*urls: str, retries: int = 4) -> ServerPool:
    timeouts = ServerTimeouts(first_byte_s=60, total_s=60)
    return ServerPool(list(urls), retries=retries, backoff_s=0.01, sleep=lambda s: None, timeouts=timeouts)


def _strip(records: list[dict]) -> dict[str, dict]:
    """Records by id without their generation settings (in process vs server differ only there)."""
    return {r["id"]: {k: v for k, v in r.items() if k != "generation"} for r in records}


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """In-process greedy regeneration of every turn and of first turns: what a server run must reproduce."""
    out = {}
    for turns in ("first", "all"):
        path = tmp_path_factory.mktemp("ref") / "regen.jsonl"
        regenerate(
            tiny, _convs(), path, progress=False, settings=RegenSettings(max_new_tokens=6, batch_size=4, turns=turns)
        )
        out[turns] = _strip(read_regenerated(path))
    return out


@pytest.mark.parametrize("protocol", ["openai", "llama.cpp", "sglang"])
@pytest.mark.parametrize("turns", ["first", "all"])
def test_server_equals_in_process(tiny, tiny_dir, tmp_path, reference, protocol, turns):
    text_only = TargetText.load(tiny_dir)  # the client never loads the weights
    with FakeServer(tiny, protocol=protocol) as srv:
        path = tmp_path / "regen.jsonl"
        stats = regenerate(
            text_only,
            _convs(),
            path,
            servers=_pool(srv.url),
            progress=False,
            settings=RegenSettings(max_new_tokens=6, turns=turns, concurrency=3),
        )
    recs = read_regenerated(path)
    assert _strip(recs) == reference[turns]
    assert stats.generated == len(QUESTIONS) and stats.retokenized == 0
    assert stats.turns == sum(len(r.get("turn_token_ids", [0])) for r in recs)
    assert srv.requests == stats.turns
    gen = recs[0]["generation"]
    assert gen["generator"] == {"kind": "server", "models": ["tiny-target"]}
    assert stats.servers[0]["protocol"] == protocol and stats.servers[0]["tokenizer_check"] == "same ids"
    if turns == "all":
        assert gen["turns"] == "all" and all(len(r["turn_token_ids"]) == 2 for r in recs if r["finished"])
    # the prompt sent is exactly the chat template's ids (no re-rendering on the server)
    firsts = [encode_prompt(text_only.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert all(p in srv.prompts for p in firsts)


def test_text_only_server_is_retokenised_and_counted(tiny, tiny_dir, tmp_path, reference):
    with FakeServer(tiny, token_ids=False) as srv:
        path = tmp_path / "regen.jsonl"
        stats = regenerate(
            TargetText.load(tiny_dir),
            _convs(),
            path,
            servers=_pool(srv.url),
            progress=False,
            settings=RegenSettings(max_new_tokens=6),
        )
    assert stats.retokenized == len(QUESTIONS)
    tok = tiny.tokenizer
    for rid, rec in _strip(read_regenerated(path)).items():
        text = rec["messages"][-1]["content"]
        expected = tok(text, add_special_tokens=False)["input_ids"] + ([2] if rec["finished"] else [])
        assert rec["response_token_ids"] == expected
        assert rec["finished"] == reference["first"][rid]["finished"]


def test_retries_and_failover(tiny, tiny_dir, tmp_path, reference):
    with FakeServer(tiny, failures=["503", "drop", "503"]) as a, FakeServer(tiny, failures=["drop"]) as b:
        path = tmp_path / "regen.jsonl"
        stats = regenerate(
            TargetText.load(tiny_dir),
            _convs(),
            path,
            servers=_pool(a.url, b.url),
            progress=False,
            settings=RegenSettings(max_new_tokens=6, concurrency=2),
        )
    assert _strip(read_regenerated(path)) == reference["first"]
    assert a.requests > 0 and b.requests > 0  # spread over both
    assert {s["url"] for s in stats.servers} == {a.url, b.url}


def test_server_killed_mid_run_the_other_finishes(tiny, tiny_dir, tmp_path, reference):
    with FakeServer(tiny) as a, FakeServer(tiny, fail_after=2) as b:  # b stops answering after 2 replies
        path = tmp_path / "regen.jsonl"
        regenerate(
            TargetText.load(tiny_dir),
            _convs(),
            path,
            servers=_pool(a.url, b.url),
            progress=False,
            settings=RegenSettings(max_new_tokens=6, turns="all", concurrency=3),
        )
        b.stop()
    recs = read_regenerated(path)
    assert len(recs) == len({r["id"] for r in recs}) == len(QUESTIONS)
    assert _strip(recs) == reference["all"]


@pytest.mark.parametrize("route", ["in-process", "server"])
def test_stop_at_starts_nothing_new_and_a_later_call_finishes(tiny, tiny_dir, tmp_path, reference, route):
    """Past `stop_at`, only the first batch / wave runs; the rest is counted and a second call adds exactly it."""
    path = tmp_path / "regen.jsonl"
    with FakeServer(tiny) as srv:
        servers = _pool(srv.url) if route == "server" else None
        target = TargetText.load(tiny_dir) if servers else tiny

        def run(stop_at: float | None):
            return regenerate(
                target,
                _convs(),
                path,
                servers=servers,
                progress=False,
                stop_at=stop_at,
                settings=RegenSettings(max_new_tokens=6, batch_size=2, concurrency=2),
            )

        first = run(time.monotonic() - 1.0)  # the deadline has passed before the call
        assert (first.generated, first.not_started) == (2, len(QUESTIONS) - 2)
        assert len(read_regenerated(path)) == 2
        if servers:
            assert srv.requests == 2
        rest = run(None)
    assert (rest.already_done, rest.generated, rest.not_started) == (2, len(QUESTIONS) - 2, 0)
    recs = read_regenerated(path)
    assert len(recs) == len({r["id"] for r in recs}) == len(QUESTIONS)
    assert _strip(recs) == reference["first"]


def test_errors_name_the_url_and_the_reason(tiny, tiny_dir, tmp_path):
    text = TargetText.load(tiny_dir)
    with FakeServer(tiny, failures=["400"]) as srv:
        expected = rf"{srv.url}/v1/completions: HTTP 400: the prompt is too long"
        with pytest.raises(ServerError, match=expected):
            regenerate(
                text,
                _convs(2),
                tmp_path / "a.jsonl",
                servers=_pool(srv.url),
                progress=False,
                settings=RegenSettings(concurrency=1),
            )
    with FakeServer(tiny, tokenizer_shift=1) as srv:
        expected = rf"{srv.url} serves tiny-target whose tokenizer differs"
        with pytest.raises(ServerError, match=expected):
            regenerate(text, _convs(2), tmp_path / "b.jsonl", servers=_pool(srv.url), progress=False)
    srv = FakeServer(tiny)  # never started: the port is closed
    srv.stop()
    with pytest.raises(ServerError, match=rf"no server answers: {srv.url} \("):
        regenerate(text, _convs(2), tmp_path / "c.jsonl", servers=_pool(srv.url), progress=False)
    with FakeServer(tiny, failures=["503"] * 10) as srv:
        expected = rf"no server answers a completion request after 3 attempts: {srv.url}"
        with pytest.raises(ServerError, match=expected):
            regenerate(text, _convs(1), tmp_path / "d.jsonl", servers=_pool(srv.url, retries=2), progress=False)
    with pytest.raises(ServerError, match="expected an http"):
        ServerPool(["localhost:8000"])


def test_resume_refuses_another_generator(tiny, tiny_dir, tmp_path):
    path = tmp_path / "regen.jsonl"
    regenerate(tiny, _convs(2), path, progress=False, settings=RegenSettings(max_new_tokens=4))
    with FakeServer(tiny) as srv, pytest.raises(Exception, match="generation settings"):
        regenerate(
            TargetText.load(tiny_dir),
            _convs(),
            path,
            servers=_pool(srv.url),
            progress=False,
            settings=RegenSettings(max_new_tokens=4),
        )


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_prepare_resumes_without_loss_or_duplicates(tiny, tiny_dir, tmp_path, reference, seed):
    """SIGKILL a real `dflashkit prepare --server` at a random moment, rerun it: every conversation once, as the
    uninterrupted run wrote it."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in _convs()))
    out = tmp_path / "out"
    with FakeServer(tiny) as srv:
        cmd = [
            sys.executable, "-m", "dflashkit", "prepare", "--data", str(data), "--out", str(out), "--target",
            str(tiny_dir), "--max-new-tokens", "6", "--turns", "all", "--server", srv.url, "--concurrency", "2",
            "--max-length", "256",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        want = 1 + seed * 2  # kill after this many answers (so the kill lands mid-run)
        while srv.requests < want and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        done = read_regenerated(out / "regenerated.jsonl")
        assert len(done) < len(QUESTIONS)  # killed before the end
        rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    recs = read_regenerated(out / "regenerated.jsonl")
    assert [r["id"] for r in recs].count("c0") == 1 and len(recs) == len({r["id"] for r in recs}) == len(QUESTIONS)
    assert _strip(recs) == reference["all"]
    rows = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    assert {r["id"].split("#")[0] for r in rows} == {c.id for c in _convs()}
