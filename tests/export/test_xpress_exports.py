"""An XPress drafter through the stages that are not decoding or training: `convert --to speculators` and back is
bit-exact (speculators' layout: `speculators_model_type: xpress`, the refiner's own tensor names), a speculators
config written with speculators' defaults imports, its other alignment (`sample_from_anchor: true`) is refused by
name; the formats whose engines have no XPress model (vLLM, llama.cpp, DeepSpec) are refused by name before anything
is written; `inspect` describes its refiner and every engine's verdict; `serve-check` refuses vLLM and llama.cpp
before decoding; `doctor` runs it."""

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
def xpress_dir(tmp_path):
    cfg = small_config(kind="xpress", xpress_rank=8, num_jacobi_passes=3, learned_mask_embedding=False,
                       mask_token_id=5)  # fmt: skip
    return write_checkpoint(tmp_path / "xpress", cfg)


def test_speculators_round_trip_is_bit_exact_and_engines_without_xpress_refuse(
    xpress_dir, tmp_path, tiny_llama_dir, capsys
):
    assert main(["convert", str(xpress_dir), str(tmp_path / "s"), "--to", "speculators"]) == 0
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    assert raw["speculators_model_type"] == "xpress" and raw["architectures"] == ["XPressSpeculator"]
    assert (raw["xpress_rank"], raw["xpress_mlp_ratio"], raw["num_jacobi_passes"]) == (8, 2, 3)
    assert raw["sample_from_anchor"] is False
    assert main(["convert", str(tmp_path / "s"), str(tmp_path / "back"), "--to", "zlab"]) == 0
    a, b = load_drafter(xpress_dir), load_drafter(tmp_path / "back")
    assert b.config == a.config and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["architectures"] == ["XPressDraftModel"] and back["dflash_config"]["xpress_rank"] == 8
    capsys.readouterr()
    for to, out, words in (
        ("vllm", "v", "no vLLM release has an XPress drafter"),
        ("gguf", "d.gguf", "llama.cpp has no XPress drafter"),
        ("deepspec", "ds", "DeepSpec's Qwen3DSparkModel has no refiner"),
    ):
        rc = main(["convert", str(xpress_dir), str(tmp_path / out), "--to", to, "--target", str(tiny_llama_dir)])
        err = capsys.readouterr().err
        assert rc != 0 and words in err and "Traceback" not in err, (to, err)
        assert not (tmp_path / out).exists(), to


def test_a_speculators_config_takes_its_defaults_and_refuses_the_other_alignment(xpress_dir, tmp_path, capsys):
    assert main(["convert", str(xpress_dir), str(tmp_path / "s"), "--to", "speculators"]) == 0
    cfg_path = tmp_path / "s" / "config.json"
    raw = json.loads(cfg_path.read_text())
    for name in ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes"):
        del raw[name]
    raw["refiner_head_unused"] = None
    cfg_path.write_text(json.dumps(raw))
    # speculators' defaults (rank 256) no longer fit the rank-8 tensors: refused by tensor, not loaded wrong
    capsys.readouterr()
    rc = main(["convert", str(tmp_path / "s"), str(tmp_path / "z"), "--to", "zlab"])
    err = capsys.readouterr().err
    assert rc != 0 and "refiner_head" in err and "Traceback" not in err, err
    raw["xpress_rank"] = 8
    raw["sample_from_anchor"] = True
    cfg_path.write_text(json.dumps(raw))
    rc = main(["convert", str(tmp_path / "s"), str(tmp_path / "z2"), "--to", "zlab"])
    err = capsys.readouterr().err
    assert rc != 0 and "sample_from_anchor" in err and "Traceback" not in err, err


def test_inspect_names_the_refiner_and_each_engine(xpress_dir, capsys):
    assert main(["inspect", str(xpress_dir), "--no-values"]) == 0
    out = capsys.readouterr().out
    assert "XPress: 3 drafts a round; refiner rank 8, 3 passes" in out
    v = {x.engine: x for x in verdicts_for_dir(xpress_dir)}
    assert v["vLLM (GPU)"].verdict == v["vLLM (CPU)"].verdict == v["llama.cpp"].verdict == "refuses"
    assert v["z-lab"].verdict == "refuses"
    assert "54448" in v["vLLM (GPU)"].why


def test_serve_check_refuses_engines_without_xpress_before_decoding(xpress_dir, tiny_llama_dir, monkeypatch):
    from dflashkit.target.model import Target

    target = Target.load(tiny_llama_dir)
    monkeypatch.setattr(sc, "dflashkit_counts", lambda *a, **k: pytest.fail("decoded before refusing"))
    for engine, words in (("vllm", "no vLLM release has an XPress"), ("llamacpp", "llama.cpp has no XPress")):
        with pytest.raises(sc.EngineUnavailable, match=words):
            sc.serve_check(target, xpress_dir, prompts=[[3, 4, 5]], engines=[engine], max_new_tokens=4)


def test_doctor_runs_an_xpress_drafter(xpress_dir, tiny_llama_dir, capsys):
    rc = main(["doctor", "--target", str(tiny_llama_dir), "--drafter", str(xpress_dir), "--prompts", "1",
               "--max-new-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert "label shift" in out and "Traceback" not in out and rc in (0, 1)
