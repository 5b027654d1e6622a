"""Opt-in (`pytest -m llamacpp`; needs scripts/build_llamacpp.sh): regeneration through a real `llama-server` serving
the embedded SmolLM2 — the same prompts and ids as in process, every turn, kill and resume of `dflashkit prepare`,
two servers, and a server killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dflashkit.data.conversations import end_of_turn_ids
from dflashkit.data.datasets import load_dataset
from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate
from dflashkit.data.server_client import ServerPool
from dflashkit.export import llamacpp
from dflashkit.target.model import Target, TargetText

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.integration,
    pytest.mark.skipif(not llamacpp.built(), reason="llama.cpp not built (scripts/build_llamacpp.sh)"),
]

N_CONVS, MAX_NEW = 10, 24


@pytest.fixture(scope="module")
def gguf():
    return llamacpp.f32_target_gguf()


@pytest.fixture(scope="module")
def text():
    return TargetText.load(None)


@pytest.fixture(scope="module")
def convs():
    return load_dataset("mtbench", N_CONVS)[0]  # two user turns each


def _server(gguf, slots=4):
    from dflashkit.export.llama_server import LlamaServer

    return LlamaServer(gguf, slots=slots, threads=2, ctx_per_slot=2048)


def test_every_turn_through_llama_server_matches_the_fp32_target(gguf, text, convs, tmp_path):
    """The F32 GGUF served by llama.cpp answers (mostly) as the fp32 HF target does; the ids are the server's own."""
    with _server(gguf) as srv:
        stats = regenerate(
            text,
            convs,
            tmp_path / "server.jsonl",
            servers=ServerPool([srv.url]),
            progress=False,
            settings=RegenSettings(max_new_tokens=MAX_NEW, turns="all", concurrency=4),
        )
    assert stats.generated == N_CONVS and stats.retokenized == 0
    assert stats.servers[0]["protocol"] == "llama.cpp" and stats.servers[0]["tokenizer_check"] == "same ids"
    target = Target.load(None)
    regenerate(
        target,
        convs,
        tmp_path / "hf.jsonl",
        progress=False,
        settings=RegenSettings(max_new_tokens=MAX_NEW, turns="all", batch_size=5),
    )
    server = {r["id"]: r for r in read_regenerated(tmp_path / "server.jsonl")}
    hf = {r["id"]: r for r in read_regenerated(tmp_path / "hf.jsonl")}
    stops = set(end_of_turn_ids(text.tokenizer, text.eos_token_id))
    first_turns_equal = 0
    for cid, rec in server.items():
        for ids in rec["turn_token_ids"]:
            assert 1 <= len(ids) <= MAX_NEW and (ids[-1] in stops or len(ids) == MAX_NEW)
        first_turns_equal += rec["turn_token_ids"][0] == hf[cid]["turn_token_ids"][0]
    assert first_turns_equal >= N_CONVS // 2, f"only {first_turns_equal}/{N_CONVS} first replies equal HF fp32 greedy"


def test_two_servers_one_killed_mid_run(gguf, text, convs, tmp_path):
    path = tmp_path / "regen.jsonl"
    with _server(gguf, slots=2) as a, _server(gguf, slots=2) as b:

        def kill_b_after_first_line() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not (path.exists() and path.read_bytes().count(b"\n") >= 1):
                time.sleep(0.02)
            b.kill()

        killer = threading.Thread(target=kill_b_after_first_line, daemon=True)
        killer.start()
        pool = ServerPool([a.url, b.url], backoff_s=0.05)
        stats = regenerate(
            text,
            convs,
            path,
            servers=pool,
            progress=False,
            settings=RegenSettings(max_new_tokens=MAX_NEW, turns="all", concurrency=4),
        )
        killer.join(timeout=60)
    recs = read_regenerated(path)
    assert sorted(r["id"] for r in recs) == sorted(c.id for c in convs)  # none lost, none twice
    served = {s["url"]: s["requests"] for s in stats.servers}
    assert served[a.url] > 0 and served[b.url] > 0  # both served before b died
    assert b.proc.poll() is not None


def test_killed_prepare_resumes_through_llama_server(gguf, tmp_path):
    out = tmp_path / "out"
    with _server(gguf) as srv:
        cmd = [
            sys.executable, "-m", "dflashkit", "prepare", "--data", "mtbench", "--limit", str(N_CONVS), "--out",
            str(out), "--max-new-tokens", str(MAX_NEW), "--turns", "all", "--server", srv.url, "--concurrency", "4",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        path = out / "regenerated.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists() and path.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        before = len(read_regenerated(path))
        assert 0 < before < N_CONVS
        rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    recs = read_regenerated(path)
    assert len(recs) == len({r["id"] for r in recs}) == N_CONVS
    report = json.loads((out / "prepare.json").read_text())
    assert report["regeneration"]["already_done"] == before and report["turns"] == "all"
    assert report["regeneration"]["servers"][0]["protocol"] == "llama.cpp"


def test_quickstart_measures_and_takes_the_server_route(tmp_path):
    from dflashkit.quickstart.run import QuickstartSettings, stage_prepare, stage_rates
    from dflashkit.quickstart.server import SERVER_CHUNK, SLOT_CHOICES

    target = Target.load(None)
    s = QuickstartSettings(out=str(tmp_path), regen_minutes=0.01, max_new_tokens_regen=16, original_text=0)
    rates = stage_rates(target, s, [1, 8])
    assert rates["regen_server_tokens_per_s"] > 0 and rates["regen_route"] in ("llama-server", "in-process")
    assert rates["regen_in_process_tokens_per_s"] > 0  # both routes timed on the same job
    slots = rates["regen_server_slots"]
    assert slots in SLOT_CHOICES and set(rates["regen_server_tokens_per_s_by_slots"]) == set(map(str, SLOT_CHOICES))
    prep = stage_prepare(target, s, tmp_path, time.monotonic() + 1, {**rates, "regen_route": "llama-server"})
    recs = read_regenerated(tmp_path / "data" / "regenerated.jsonl")
    # the first wave always runs; nothing starts after the deadline, so the chunk is cut short
    assert prep["regen_route"] == "llama-server" and slots <= len(recs) < SERVER_CHUNK * slots
    assert all(
        r["generation"]["generator"] == {"kind": "server", "models": ["SmolLM2-135M-Instruct.F32.gguf"]} for r in recs
    )
