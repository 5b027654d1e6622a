"""serve-check --server against a live llama-server that dflashkit did not configure (opt-in: `pytest -m llamacpp`,
skipped unless scripts/build_llamacpp.sh has built llama.cpp; a few minutes on 2 cores, mostly the drafter's training).

A drafter trained for a minute on the embedded SmolLM2's own continuations of four chats (so it accepts often), exported
to GGUF and served by `llama-server -md … --spec-type draft-dflash --metrics` as a user starts it:
- on the F32 target the engine's counters equal, prompt by prompt and position by position, what dflashkit's drafter
  accepts on the server's output with llama-server's round rule; the outputs equal the target's greedy output; the
  server's chat template renders the prompts as trained; no cause is named — with --metrics and without it;
- the same drafter over a 4-bit target (Q4_0, re-quantized by llama-quantize) is diagnosed as other numerics;
- a GGUF whose target layers are one off is diagnosed from the served file, naming target_layer_ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflashkit.export import llamacpp
from dflashkit.export.served import ServedSettings, check_server, served_config
from dflashkit.export.served_diagnosis import same_counts

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.integration,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not llamacpp.built(), reason="llama.cpp not built (scripts/build_llamacpp.sh)"),
]

QUESTIONS = [
    "Write a Python function that reverses a list.",
    "What is the capital of France, and why?",
    "List three colours of the rainbow.",
    "Explain what a CPU does in one paragraph.",
]
N = 32


@pytest.fixture(scope="module")
def target():
    from dflashkit.target.model import Target

    return Target.load("default")


@pytest.fixture(scope="module")
def prompts(target):
    from dflashkit.data.conversations import encode_prompt

    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [
        SimpleNamespace(id=f"p{i}", ids=encode_prompt(target.tokenizer, m), messages=m) for i, m in enumerate(chats)
    ]


@pytest.fixture(scope="module")
def trained(target, prompts, tmp_path_factory) -> Path:
    """A one-layer block-4 drafter trained on the target's own greedy continuations of the prompts."""
    from dflashkit.decode.generate import DecodeSettings, generate
    from dflashkit.train.config import TrainConfig
    from dflashkit.train.loop import train

    root = tmp_path_factory.mktemp("served_live")
    with (root / "tokens.jsonl").open("w") as f:
        for p in prompts:
            out = generate(target, p.ids, settings=DecodeSettings(method="ar", max_new_tokens=80)).tokens
            mask = [0] * len(p.ids) + [1] * len(out)
            f.write(json.dumps({"id": p.id, "input_ids": p.ids + out, "loss_mask": mask}) + "\n")
    cfg = TrainConfig(
        out=str(root / "run"), target="default", tokens=str(root / "tokens.jsonl"), online=True,
        drafter={"num_hidden_layers": 1, "block_size": 4}, max_steps=80, max_tokens=512, save_every=100000,
        lr=3e-3, progress=False, tensorboard=False,
    )  # fmt: skip
    train(cfg, target=target)
    return root / "run" / "final"


def _gguf(src: Path, out: Path) -> Path:
    from dflashkit.export.gguf_export import export_gguf

    export_gguf(src, out, target=llamacpp.f32_target_gguf(), outtype="f32")
    return out


def _served(target_gguf: Path, drafter_gguf: Path, *, metrics: bool = True):
    from dflashkit.export.llama_server import LlamaServer

    args = ["-md", str(drafter_gguf), "--spec-type", "draft-dflash", "--spec-draft-n-max", "3"]
    return LlamaServer(target_gguf, slots=1, threads=2, extra_args=args + (["--metrics"] if metrics else []))


@pytest.mark.parametrize("metrics", [True, False])
def test_a_live_llama_server_reports_what_dflashkit_computes(target, prompts, trained, tmp_path, metrics):
    from dflashkit.export.convert import load_any_drafter

    drafter = load_any_drafter(trained, target=target).eval()
    gguf = _gguf(trained, tmp_path / "drafter.gguf")
    with _served(llamacpp.f32_target_gguf(), gguf, metrics=metrics) as srv, torch.no_grad():
        report = check_server(
            target, drafter, srv.url, prompts, settings=ServedSettings(N, served_config=served_config(gguf))
        )
    assert report.findings == [], report.render()
    assert report.engine == ("llamacpp" if metrics else "llama.cpp answers")
    for p in report.prompts:
        assert p.same_tokens or p.near_tie is not None, report.render()
        assert same_counts(p.engine, p.teacher_forced), report.render()
        if metrics:
            assert p.engine.accepted_per_pos == p.teacher_forced.accepted_per_pos
    assert report.summary()["engine"]["accepted"] > 0  # the drafter is accepted: the equality is not one of zeros


def test_a_live_quantized_target_is_diagnosed_as_numerics(target, prompts, trained, tmp_path):
    from dflashkit.export.convert import load_any_drafter

    drafter = load_any_drafter(trained, target=target).eval()
    gguf = _gguf(trained, tmp_path / "drafter.gguf")
    with _served(llamacpp.target_gguf("Q4_0"), gguf) as srv:
        report = check_server(target, drafter, srv.url, prompts, settings=ServedSettings(N))
    assert "numerics" in [f.cause for f in report.findings], report.render()


def test_a_live_gguf_with_layer_ids_one_off_is_named_from_the_served_file(target, prompts, trained, tmp_path):
    from dflashkit.export.convert import load_any_drafter

    drafter = load_any_drafter(trained, target=target).eval()
    wrong = tmp_path / "wrong"
    shutil.copytree(trained, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    ids = cfg["dflash_config"]["target_layer_ids"]
    cfg["dflash_config"]["target_layer_ids"] = [i + 1 for i in ids]
    (wrong / "config.json").write_text(json.dumps(cfg))
    gguf = _gguf(wrong, tmp_path / "wrong.gguf")
    with _served(llamacpp.f32_target_gguf(), gguf) as srv:
        report = check_server(
            target, drafter, srv.url, prompts, settings=ServedSettings(N, served_config=served_config(gguf))
        )
    (f,) = report.findings
    assert f.cause == "config" and "target_layer_ids" in f.line, report.render()
