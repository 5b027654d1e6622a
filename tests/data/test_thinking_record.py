"""The thinking mode travels from prepare through capture and training into the drafter, and capture / eval /
simulate refuse work in another mode (dflashkit.data.thinking)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflashkit.cli import main
from dflashkit.data.thinking import check_same_thinking, data_info, template_kwargs
from dflashkit.drafter.checkpoint import save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import ConfigError
from dflashkit.features.manifest import Manifest


def _drafter_for(path, thinking: str | None):
    """A small drafter that fits the tiny SmolLM2-vocabulary target, trained (as recorded) in `thinking` mode."""
    cfg = DrafterConfig(
        hidden_size=16, vocab_size=49152, num_target_layers=2, target_layer_ids=[0, 1], num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32, block_size=4,
        extra={"data": {"thinking": thinking} if thinking else {"turns": "first"}},
    )  # fmt: skip
    return save_drafter(DFlashDrafter(cfg), path)


@pytest.fixture(scope="module")
def prepared(thinking_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep")
    data = out / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Hi there"}]}) + "\n")
    argv = ["prepare", "--data", str(data), "--out", str(out), "--target", str(thinking_dir), "--thinking", "keep"]
    assert main([*argv, "--max-new-tokens", "4"]) == 0
    return out


def test_data_info_and_capture_record_the_mode(thinking_dir, prepared, tmp_path):
    info = data_info(prepared / "tokens.jsonl")
    assert info == {"thinking": "keep", "turns": "first", "chat_template_kwargs": {"enable_thinking": True}}
    assert data_info(tmp_path / "tokens.jsonl") == {}  # no prepare.json: unknown
    feats = tmp_path / "feats"
    argv = ["capture", "--tokens", str(prepared / "tokens.jsonl"), "--out", str(feats), "--target", str(thinking_dir)]
    assert main([*argv, "--layer-ids", "0,1", "--dtype", "fp32", "--quiet"]) == 0
    assert Manifest.load(feats).data == info
    # training carries it into the drafter's config (from the manifest, or from prepare.json when online)
    from dflashkit.features.captured import CapturedFeatures
    from dflashkit.train.run import _record_data_info

    for source, tokens in ((CapturedFeatures(feats), None), (object(), prepared / "tokens.jsonl")):
        cfg = DrafterConfig(hidden_size=16, vocab_size=49152, num_target_layers=2, target_layer_ids=[0, 1])
        _record_data_info(SimpleNamespace(tokens=tokens), source, cfg)
        assert cfg.extra["data"] == info and cfg.extra["chat_template_kwargs"] == {"enable_thinking": True}


def test_capture_refuses_a_drafter_of_another_mode(thinking_dir, prepared, tmp_path, capsys):
    ckpt = _drafter_for(tmp_path / "d", "off")
    argv = ["capture", "--tokens", str(prepared / "tokens.jsonl"), "--out", str(tmp_path / "f"), "--target"]
    assert main([*argv, str(thinking_dir), "--drafter-config", str(ckpt), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "prepared with --thinking off" in err and "uses prepare --thinking keep" in err


def test_eval_and_simulate_refuse_another_mode(thinking_dir, tmp_path, capsys):
    ckpt = _drafter_for(tmp_path / "d", "keep")
    for cmd in (["eval", "--methods", "chain"], ["simulate", "--cache", str(tmp_path / "c")]):
        argv = [*cmd, "--target", str(thinking_dir), "--drafter", f"x={ckpt}", "--dataset", "mtbench"]
        assert main([*argv, "--out", str(tmp_path / "o"), "--thinking", "off"]) == 2
        err = capsys.readouterr().err
        assert "drafter 'x'" in err and "--thinking keep" in err and "--thinking off" in err
        assert main([*argv, "--out", str(tmp_path / "o")]) == 2  # no --thinking: the template's default differs
        assert "template's default" in capsys.readouterr().err


def test_rules():
    check_same_thinking("keep", "keep", where="x")
    check_same_thinking(None, None, where="x")
    with pytest.raises(ConfigError, match="pass --thinking on"):
        check_same_thinking("on", "keep", where="x")
    tok = SimpleNamespace(chat_template="{{ messages }}")
    assert template_kwargs(None, tok, "t") == {}
    with pytest.raises(ConfigError, match="no enable_thinking switch"):
        template_kwargs("off", tok, "t")
