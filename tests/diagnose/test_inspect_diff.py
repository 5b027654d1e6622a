"""`inspect` and `diff`: facts read from tensors, config/tensor inconsistencies named, broken checkpoints described,
architectural differences in words (4-of-5 fc, copied geometry, …) and weight statistics."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.cli import main
from dflashkit.diagnose.diff import diff_checkpoints, target_geometry
from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint
from dflashkit.drafter.model import DFlashDrafter
from helpers.checkpoints import small_config, write_checkpoint


def lines_of(report) -> list[str]:
    return [f.line() for f in report.findings]


# ---------------------------------------------------------------------------------------------- inspect
def test_inspect_healthy_checkpoint(tmp_path, capsys):
    cfg = small_config()
    path = write_checkpoint(tmp_path / "ok", cfg)
    r = inspect_checkpoint(path)
    assert r.ok and r.format == "zlab"
    f = r.facts
    assert f["fc_features"] == 5 and f["target_layer_ids"] == [1, 2, 3, 4, 5]
    assert f["tensor_geometry"] == {"head_dim": 16, "heads": 4, "kv_heads": 2, "intermediate": 96}
    assert f["parameters"] == DFlashDrafter(cfg).num_parameters()
    assert f["mask"]["learned_embedding_tensor"] and f["bytes"] > 0
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fc reads 5 layers ([64, 320])" in out and "config.json and tensors agree" in out
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["facts"]["fc_features"] == 5


def test_inspect_four_of_five_fc(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "four", small_config(), fc_features=4)
    r = inspect_checkpoint(path)
    assert not r.ok
    assert any(
        line.startswith(
            "FAIL fc width: fc reads 4 target layers (fc.weight [64, 256] = 4 × hidden 64) "
            "but config.json names 5 (target_layer_ids [1, 2, 3, 4, 5])"
        )
        for line in lines_of(r)
    )
    assert main(["inspect", str(path)]) == 1
    assert "fc reads 4 target layers" in capsys.readouterr().out


def test_inspect_geometry_and_keys_disagree_with_config(tmp_path):
    own = small_config(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    path = write_checkpoint(tmp_path / "geo", own)
    raw = json.loads((path / "config.json").read_text())
    raw.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # config lies about the geometry
    (path / "config.json").write_text(json.dumps(raw))
    lines = lines_of(inspect_checkpoint(path))
    assert any(
        "FAIL geometry: tensors say 2 heads × 32 with 1 kv heads; config.json says 4 × 16 with 2" in x for x in lines
    )
    assert any("tensor 'layers.0.self_attn.q_norm.weight' has shape [32], config.json implies [16]" in x for x in lines)

    def edit(sd):
        del sd["norm.weight"]
        sd["lm_head.weight"] = torch.zeros(97, 64)

    lines = lines_of(inspect_checkpoint(write_checkpoint(tmp_path / "keys", small_config(), edit=edit)))
    assert any("FAIL tensors: missing tensors ['norm.weight']" in x for x in lines)
    assert any("FAIL tensors: unexpected tensors ['lm_head.weight']" in x for x in lines)


def test_inspect_partial_and_unreadable_checkpoints_name_the_problem(tmp_path, capsys):
    assert "does not exist" in lines_of(inspect_checkpoint(tmp_path / "nope"))[0]
    path = write_checkpoint(tmp_path / "p", small_config())
    (path / "config.json").unlink()
    r = inspect_checkpoint(path)
    assert any("config.json is missing" in x for x in lines_of(r))
    assert r.facts["fc_features"] == 5  # still described from the tensors
    path = write_checkpoint(tmp_path / "w", small_config())
    (path / "model.safetensors").unlink()
    assert any(
        "no model.safetensors (or model.safetensors.index.json)" in x for x in lines_of(inspect_checkpoint(path))
    )
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    assert any("model.safetensors is not a readable safetensors file" in x for x in lines_of(inspect_checkpoint(path)))
    (path / "model.safetensors").unlink()
    index = {"weight_map": {"fc.weight": "model-00001.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert any("shard file(s) ['model-00001.safetensors']" in x for x in lines_of(inspect_checkpoint(path)))
    assert main(["inspect", str(path)]) == 1
    assert "model-00001.safetensors" in capsys.readouterr().out


def test_inspect_flags_non_finite_weights(tmp_path):
    path = write_checkpoint(
        tmp_path / "nan",
        small_config(),
        edit=lambda sd: sd["layers.0.mlp.up_proj.weight"].__setitem__((0, 0), float("nan")),
    )
    assert any(
        "FAIL values: non-finite values (NaN/inf) in ['layers.0.mlp.up_proj.weight']" in x
        for x in lines_of(inspect_checkpoint(path))
    )


# ---------------------------------------------------------------------------------------------- diff
def test_diff_names_the_left_out_layer(tmp_path, capsys):
    a = write_checkpoint(tmp_path / "a", small_config(target_layer_ids=[1, 3, 5, 6]))
    b = write_checkpoint(tmp_path / "b", small_config(target_layer_ids=[1, 3, 5, 6, 7]))
    d = diff_checkpoints(a, b)
    assert "A's fc reads 4 target layers (256 → 64), B's reads 5 (320 → 64): A leaves out layer 7" in d.differences
    assert main(["diff", str(a), str(b)]) == 0
    assert "A leaves out layer 7" in capsys.readouterr().out


def test_diff_with_a_side_that_is_not_a_drafter_says_not_compared(tmp_path, capsys):
    """Never "no differences" between a drafter and a file that is not one: the side is named, exit 1."""
    a = write_checkpoint(tmp_path / "a", small_config())
    (tmp_path / "config.json").write_text("{}")
    d = diff_checkpoints(a, tmp_path / "config.json")
    assert not d.compared and "B" in d.problems and "A" not in d.problems and d.differences == []
    assert main(["diff", str(a), str(tmp_path / "config.json")]) == 1
    out = capsys.readouterr().out
    assert "Not compared: B could not be read as a drafter checkpoint" in out and "no differences" not in out
    assert main(["diff", str(tmp_path / "missing"), str(a), "--json"]) == 1
    assert '"compared": false' in capsys.readouterr().out


def test_diff_four_of_five_against_healthy(tmp_path):
    a = write_checkpoint(tmp_path / "a", small_config(), fc_features=4)
    b = write_checkpoint(tmp_path / "b", small_config())
    d = diff_checkpoints(a, b)
    assert "A's fc reads 4 target layers (256 → 64), B's reads 5 (320 → 64)" in d.differences
    assert "A's config names 5 target layers [1, 2, 3, 4, 5] but its fc reads 4" in d.differences
    assert any("fc reads 4 target layers" in x for x in d.problems["A"])


def test_diff_geometry_copied_from_recorded_target(tmp_path):
    extra = {"target_geometry": {"num_attention_heads": 2, "head_dim": 32}, "target_architecture": "LlamaForCausalLM"}
    a = write_checkpoint(
        tmp_path / "a", small_config(num_attention_heads=2, num_key_value_heads=1, head_dim=32, extra=extra)
    )
    b = write_checkpoint(tmp_path / "b", small_config(extra=extra))
    d = diff_checkpoints(a, b)
    assert any(
        x.startswith(
            "A's attention geometry equals its target's (head_dim 32, 2 heads; target geometry "
            "from recorded in the checkpoint), B uses its own (16, 4)"
        )
        for x in d.differences
    )


def test_diff_geometry_with_target(tmp_path, wide_head_target, capsys):
    from dflashkit.target.model import Target

    a = write_checkpoint(
        tmp_path / "a",
        small_config(
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_target_layers=4, target_layer_ids=[0, 1, 2]
        ),
    )
    b = write_checkpoint(tmp_path / "b", small_config(num_target_layers=4, target_layer_ids=[0, 1, 2]))
    d = diff_checkpoints(a, b, target=Target.load(wide_head_target))
    assert any(
        "A's attention geometry equals its target's (head_dim 32, 2 heads; target geometry from the "
        "--target), B uses its own (16, 4)" in x
        for x in d.differences
    )
    assert main(["diff", str(a), str(b), "--target", str(wide_head_target), "--json", "--no-weights"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("A's attention geometry equals its target's" in x for x in data["differences"])
    assert data["weights"] == {}
    # without a target nothing is guessed: only the plain geometry difference
    d = diff_checkpoints(a, b)
    assert not any("equals its target" in x for x in d.differences)
    assert "attention: A has 2 heads × 32 with 1 kv heads, B has 4 × 16 with 2" in d.differences


def test_known_target_family_geometry():
    facts = {"hidden_size": 5120, "extra": {"target_architecture": "Qwen3_5ForConditionalGeneration"}}
    assert target_geometry(facts)[:2] == (24, 256)
    assert target_geometry({"hidden_size": 4096, "extra": {"target_architecture": "Qwen3ForCausalLM"}})[:2] == (32, 128)
    assert target_geometry({"hidden_size": 64, "extra": {"target_architecture": "Qwen3ForCausalLM"}}) is None


def test_diff_fields_and_weight_statistics(tmp_path):
    cfg = small_config()
    a = write_checkpoint(tmp_path / "a", cfg)
    other = cfg.replace(
        block_size=8,
        learned_mask_embedding=False,
        mask_token_id=3,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        layer_types=["sliding_attention"],
        sliding_window=64,
    )

    def perturb(sd):
        sd["layers.0.mlp.down_proj.weight"] = -sd["layers.0.mlp.down_proj.weight"] * 2

    b = write_checkpoint(tmp_path / "b", other, edit=perturb)
    d = diff_checkpoints(a, b)
    text = "\n".join(d.differences)
    for words in (
        "block size: A 4, B 8",
        "mask: A uses a learned mask embedding, B uses mask token 3",
        "rope θ: A 1000000.0, B 10000.0",
        "norm ε: A 1e-06, B 1e-05",
        "sliding window: A None, B 64",
        "layer types: A ['full_attention'], B ['sliding_attention']",
    ):
        assert words in text
    w = d.weights
    worst = w["most_different"][0]
    assert worst["tensor"] == "layers.0.mlp.down_proj.weight"
    assert worst["cosine"] == pytest.approx(-1.0) and worst["norm_ratio"] == pytest.approx(2.0)
    assert w["identical"] == w["compared"] - 1 and w["only_in_a"] == ["mask_embedding"]


def test_inspect_and_diff_know_dspark_drafters(tmp_path, capsys):
    dspark = write_checkpoint(tmp_path / "s", small_config(kind="dspark", markov_rank=8))
    plain = write_checkpoint(tmp_path / "p", small_config())
    assert main(["inspect", str(dspark)]) == 0
    out = capsys.readouterr().out
    assert "DSpark: 4 drafts a round; Markov head rank 8, a confidence head" in out
    engines = {v["engine"]: v["verdict"] for v in inspect_checkpoint(dspark).facts["engines"]}
    assert engines["vLLM (CPU)"] == "refuses" and engines["z-lab"] == "refuses"
    assert engines["vLLM (GPU)"] == "degrades"  # a learned mask: vLLM's DSpark model drops it
    assert engines["llama.cpp"] == "converts"
    assert "DFlash: 3 drafts a round" in (main(["inspect", str(plain)]) or capsys.readouterr().out)
    rep = diff_checkpoints(plain, dspark, weights=False)
    assert any(line.startswith("drafter kind") and "B dspark" in line for line in rep.differences)
