"""A Domino drafter through the stages that are not decoding or training: `convert` keeps the references' layout
(z-lab) bit-exactly and refuses, by name and before writing anything, the formats whose engines have no Domino model
(vLLM, llama.cpp, speculators, DeepSpec); `inspect` describes its head and every engine's verdict; `serve-check`
refuses vLLM and llama.cpp before decoding; `simulate` and `doctor` run it."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.cli import main
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.export import serve_check as sc
from dflashkit.export.engines import verdicts_for_dir
from helpers.checkpoints import small_config, write_checkpoint


@pytest.fixture()
def domino_dir(tmp_path):
    cfg = small_config(kind="domino", gru_hidden_dim=12, emb_dim=10, learned_mask_embedding=False, mask_token_id=5)
    return write_checkpoint(tmp_path / "domino", cfg)


def test_convert_keeps_the_reference_layout_and_refuses_engines_without_domino(
    domino_dir, tmp_path, tiny_llama_dir, capsys
):
    assert main(["convert", str(domino_dir), str(tmp_path / "z"), "--to", "zlab"]) == 0
    a, b = load_drafter(domino_dir), load_drafter(tmp_path / "z")
    assert b.config == a.config and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    raw = json.loads((tmp_path / "z" / "config.json").read_text())
    assert raw["dflash_config"]["projector_type"] == "domino" and raw["architectures"] == ["DFlashDraftModel"]
    capsys.readouterr()
    for to, out, words in (
        ("vllm", "v", "vLLM has no Domino drafter model"),
        ("gguf", "d.gguf", "llama.cpp has no Domino drafter"),
        ("speculators", "s", "speculators has no Domino model"),
        ("deepspec", "ds", "DeepSpec's Qwen3DSparkModel has no GRU correction head"),
    ):
        rc = main(["convert", str(domino_dir), str(tmp_path / out), "--to", to, "--target", str(tiny_llama_dir)])
        err = capsys.readouterr().err
        assert rc != 0 and words in err and "Traceback" not in err, (to, err)
        assert not (tmp_path / out).exists(), to


def test_inspect_names_the_head_and_each_engine(domino_dir, capsys):
    assert main(["inspect", str(domino_dir), "--no-values"]) == 0
    out = capsys.readouterr().out
    assert "Domino: 4 drafts a round; GRU 12, correction width 10, first 1 uncorrected" in out
    v = {x.engine: x for x in verdicts_for_dir(domino_dir)}
    assert v["vLLM (GPU)"].verdict == v["vLLM (CPU)"].verdict == v["llama.cpp"].verdict == "refuses"
    assert v["z-lab"].verdict == "refuses" and v["SGLang"].verdict == "unverified"
    assert "Domino" in v["SGLang"].why


def test_serve_check_refuses_engines_without_domino_before_decoding(domino_dir, tiny_llama_dir, monkeypatch):
    from dflashkit.target.model import Target

    target = Target.load(tiny_llama_dir)
    monkeypatch.setattr(sc, "dflashkit_counts", lambda *a, **k: pytest.fail("decoded before refusing"))
    for engine, words in (("vllm", "vLLM has no Domino"), ("llamacpp", "llama.cpp has no Domino")):
        with pytest.raises(sc.EngineUnavailable, match=words):
            sc.serve_check(target, domino_dir, prompts=[[3, 4, 5]], engines=[engine], max_new_tokens=4)


def test_simulation_equals_the_real_loop_and_doctor_runs(domino_dir, tmp_path, tiny_llama_dir, capsys):
    """Teacher-forced simulation of a Domino drafter (its corrected rollout, its path-state DDTree) gives the real
    decode loop's acceptance length round by round."""
    from dflashkit.decode.generate import DecodeSettings, generate
    from dflashkit.evaluate.simulate import simulate
    from dflashkit.evaluate.transcripts import build_transcripts
    from dflashkit.target.model import Target
    from helpers.oracles import make_prompts

    target = Target.load(tiny_llama_dir)
    d = load_drafter(domino_dir).eval()
    prompts = make_prompts(2)
    cache = build_transcripts(target, prompts, tmp_path / "tr", max_new_tokens=20, layer_ids=[1, 2, 3, 4, 5],
                              progress=False)  # fmt: skip
    sim = simulate(d, cache, tree_budgets=[4], tree_top_k=3)
    for method, kw in (("chain", {}), ("ddtree:4", {"method": "tree", "tree_budget": 4, "tree_top_k": 3})):
        for p in prompts:
            res = generate(target, p.ids, drafter=d, settings=DecodeSettings(max_new_tokens=20, **kw))
            assert sim[method]["per_prompt"][p.id] == res.acceptance_lengths, (method, p.id)
    rc = main(["doctor", "--target", str(tiny_llama_dir), "--drafter", str(domino_dir), "--prompts", "1",
               "--max-new-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert "label shift" in out and "Traceback" not in out and rc in (0, 1)
