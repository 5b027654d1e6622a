"""The real engine: dflashkit's GGUF drafters inside llama.cpp (opt-in: these run only after
scripts/build_llamacpp.sh has built llama.cpp into the user cache; `pytest -m llamacpp` selects them).

For SmolLM2-shaped drafters in the three layouts (mask = a real embedding row; learned mask embedding; learned mask
+ reduced 8192-token vocabulary, the quickstart's drafter), DSpark and DFlash2 drafters, with the embedded SmolLM2
target:
- the GGUF loads in llama-speculative-simple and llama-server (`--spec-type draft-dflash`; a DSpark drafter with
  `draft-dspark`, its Markov head chained left to right in llama.cpp's graph; a DFlash2 drafter with `draft-dflash`,
  its convolutions and candidate selector walked in llama.cpp's graph);
- greedy output with speculation equals plain llama.cpp decoding (Q4_1 target and F32 target);
- on the F32 target, llama.cpp's top-1 drafts equal dflashkit's PyTorch drafts in every slot of every round
  (slots where PyTorch's own top-2 logits are within 0.02 are numerical ties and are counted, not failed).
The drafters are random (weights scaled up so logits have margins): these tests check that the file means the
same network in both engines, not that the drafter is good.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from dflashkit.cpu_products.machine import machine_line
from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.export import llamacpp
from dflashkit.export.gguf_export import export_gguf
from dflashkit.export.llamacpp_check import TIE, llamacpp_side, reference_drafts
from helpers.oracles import reference_greedy

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.integration,
    pytest.mark.skipif(not llamacpp.built(), reason="llama.cpp not built (scripts/build_llamacpp.sh)"),
]

PROMPTS = [
    "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France, and why?<|im_end|>\n<|im_start|>assistant\n",
]
VARIANTS = ("real_row", "learned", "learned_d8192", "dspark_d8192", "dflash2_real_row", "dflash2_learned_d8192")


def spec_args(name: str) -> dict:
    """llama.cpp's speculative type and draft count for a variant: DSpark drafts every slot of its block of 4."""
    return {"spec_type": "draft-dspark", "n_max": 4} if name.startswith("dspark") else {"n_max": 3}


@pytest.fixture(scope="module")
def target():
    from dflashkit.target.model import Target

    return Target.load("default")


@pytest.fixture(scope="module")
def ggufs() -> dict[str, Path]:
    from dflashkit.target.default import gguf_path

    return {"q4_1": gguf_path(), "f32": llamacpp.f32_target_gguf()}


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, Path]:
    """Checkpoint directories of the three layouts (the quickstart's geometry: 2 layers, block 4)."""
    from dflashkit.drafter.defaults import default_drafter_config

    root = tmp_path_factory.mktemp("llamacpp_drafters")
    out = {}
    for i, name in enumerate(VARIANTS):
        # 16: <empty_output>, never produced (the default mask row for SmolLM2)
        overrides = {"mask_token_id": 16} if name.endswith("real_row") else {"learned_mask_embedding": True}
        if name.startswith("dspark"):  # the Markov head (W1, W2 random below) and the confidence head
            overrides.update(kind="dspark", markov_rank=64)
        if name.startswith("dflash2"):  # convolutions (moved off the identity below) and the candidate selector
            overrides.update(kind="dflash2", selector_rank=64)
        if name.endswith("d8192"):
            overrides["draft_vocab_size"] = 8192
        cfg = default_drafter_config(target, num_hidden_layers=2, block_size=4, **overrides)
        assert cfg.learned_mask_embedding == (not name.endswith("real_row"))
        torch.manual_seed(i)
        d = DFlashDrafter(cfg)
        with torch.no_grad():
            for p in d.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
            if cfg.learned_mask_embedding:
                d.mask_embedding.normal_(0.0, 0.1)
            for layer in d.layers if cfg.kind == "dflash2" else ():
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.normal_(0.0, 0.3)
                    conv.base_kernel[:, 0] += 1.0
            if cfg.draft_vocab_size:
                d.draft_to_target.copy_(torch.randperm(cfg.vocab_size)[:8192].sort().values)
        out[name] = save_drafter(d, root / name)
    return out


def _gguf(drafters, ggufs, tmp_path_factory, name: str, tgt: str) -> Path:
    out = tmp_path_factory.getbasetemp() / f"{name}.{tgt}.gguf"
    if not out.exists():
        export_gguf(drafters[name], out, target=ggufs[tgt], outtype="f32")
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_drafts_equal_pytorch_on_f32_target(name, target, drafters, ggufs, tmp_path_factory):
    drafter = load_drafter(drafters[name])
    gguf_file = _gguf(drafters, ggufs, tmp_path_factory, name, "f32")
    if name.startswith("dflash2"):  # llama.cpp logs no DFlash2 drafts: its acceptance per round against ours
        for prompt in PROMPTS:
            ids = target.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            greedy = reference_greedy(target, torch.tensor(ids), 28)
            theirs, ours, _ = llamacpp_side(target, drafter, gguf_file, ggufs["f32"], ids, 24, known_output=greedy)
            assert theirs["tokens"] == greedy[:24] and theirs["drafts"] >= 6
            assert theirs["accepted_per_pos"] == ours["accepted_per_pos"]
        return
    slots = ties = 0
    for prompt in PROMPTS:
        run = llamacpp.run_speculative(ggufs["f32"], prompt, drafter=gguf_file, n_predict=24, **spec_args(name))
        assert len(run.rounds) >= 6, run.log[-2000:]
        ids = target.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for r, (ref, margin) in zip(run.rounds, reference_drafts(target, drafter, ids, run), strict=True):
            assert len(r.draft) == len(ref)
            for got, want, m in zip(r.draft, ref, margin, strict=True):
                slots += 1
                if got != want:
                    assert m < TIE, f"slot draft {got} ≠ PyTorch {want} with a clear margin {m:.3f}"
                    ties += 1
    assert slots >= 36 and ties <= slots // 20, (slots, ties)


@pytest.mark.parametrize("tgt", ["q4_1", "f32"])
@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_output_equals_plain_llamacpp(name, tgt, drafters, ggufs, tmp_path_factory):
    gguf_file = _gguf(drafters, ggufs, tmp_path_factory, name, tgt)
    for prompt in PROMPTS[:1]:
        plain = llamacpp.run_plain(ggufs[tgt], prompt, n_predict=32)
        spec = llamacpp.run_speculative(ggufs[tgt], prompt, drafter=gguf_file, n_predict=32, **spec_args(name))
        assert_same_greedy(spec.text.split(prompt, 1)[-1], plain.text)
        assert spec_args(name).get("spec_type", "draft-dflash") in spec.log and len(spec.rounds) > 0


def test_portable_build_names_the_cpu_variant_it_ran(ggufs, record_property, capsys):
    """The build carries one CPU backend per x86 level and each run loads the best one this CPU supports; the
    engine tests record which (and that it is not the AMX variant the build script leaves out)."""
    shipped = sorted(p.name for p in llamacpp.tool("llama-completion").parent.glob("libggml-cpu-*.so"))
    assert len(shipped) >= 2 and not any("sapphirerapids" in n for n in shipped), shipped
    for tgt in ("q4_1", "f32"):
        run = llamacpp.run_plain(ggufs[tgt], PROMPTS[0], n_predict=4)
        variant = run.cpu_variant
        assert variant and f"libggml-cpu-{variant}.so" in shipped, run.log[-2000:]
        record_property(f"llamacpp_cpu_variant_{tgt}", variant)
        with capsys.disabled():
            print(f"\n[llama.cpp] {tgt}: CPU variant {variant} ({machine_line()})")


def assert_same_greedy(a: str, b: str) -> None:
    """Two greedy continuations of one prompt agree up to the shorter one (the tools stop at ±1 token)."""
    a, b = a.strip(), b.strip()
    n = min(len(a), len(b))
    assert n >= 20 and a[:n] == b[:n], (a, b)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gguf_loads_in_llama_server(drafters, ggufs, tmp_path_factory):
    gguf_file = _gguf(drafters, ggufs, tmp_path_factory, "learned_d8192", "q4_1")
    port = _free_port()
    proc = subprocess.Popen(
        [
            str(llamacpp.tool("llama-server")),
            "-m",
            str(ggufs["q4_1"]),
            "-md",
            str(gguf_file),
            "--spec-type",
            "draft-dflash",
            "--spec-draft-n-max",
            "3",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "2",
            "-c",
            "1024",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "llama-server did not become healthy"
            time.sleep(0.5)
        body = json.dumps({"prompt": PROMPTS[0], "n_predict": 24, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{url}/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            content = json.loads(r.read())["content"]
        plain = llamacpp.run_plain(ggufs["q4_1"], PROMPTS[0], n_predict=24)
        assert_same_greedy(content, plain.text)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("name", ["learned_d8192", "dspark_d8192", "dflash2_learned_d8192"])
def test_serve_check_llamacpp_agrees_round_by_round(target, drafters, tmp_path, name):
    """`serve-check --engine llamacpp` on the quickstart-shaped drafter (reduced vocabulary, learned mask) exported in
    the serving layout: llama.cpp's output equals dflashkit's greedy output and its accepted drafts per position
    equal those of dflashkit's drafter on llama.cpp's own rounds."""
    from dflashkit.export.convert import convert
    from dflashkit.export.serve_check import serve_check

    served = tmp_path / "served"
    convert(drafters[name], served, to="vllm", target=target)
    ids = [target.tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    report = serve_check(target, served, prompts=ids, max_new_tokens=24, engines=["llamacpp"], progress=False)
    engine = report.engines[0]
    assert engine.engine == "llama.cpp" and report.agrees, report.render()
    assert sum(c.drafts for c in engine.theirs) >= 2 * 6
