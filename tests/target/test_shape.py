"""A target's shape from its config.json alone (`read_target_shape`): the published configs of Qwen3-8B,
Qwen3-30B-A3B and Qwen3.6-27B against their published totals and a closed-form count, the tiny targets against
the parameters of the real models, the embedded default, and bad input as one line naming the file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIG, TINY_VOCAB

from dflashkit.errors import TargetError
from dflashkit.target.files import check_model_dir
from dflashkit.target.shape import TargetShape, read_target_shape
from tests.helpers.published_configs import QWEN3_6_27B, QWEN3_6_27B_LAYERS, QWEN3_8B, QWEN3_30B_A3B


def _target(tmp_path: Path, raw: dict, name: str = "model") -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(raw))
    return tmp_path / name


def _qwen3_count(c: dict) -> tuple[int, int]:
    """(total, active) parameters of a Qwen3 / Qwen3-MoE decoder written out by hand: per layer q/k/v/o, the
    per-head q/k norms, the MLP (or router + experts) and two norms; embeddings, final norm, untied LM head."""
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attention = h * q + 2 * h * kv + q * h + 2 * hd
    if "num_experts" in c:
        expert = 3 * h * c["moe_intermediate_size"]
        mlp, idle = c["num_experts"] * (h + expert), (c["num_experts"] - c["num_experts_per_tok"]) * expert
    else:
        mlp, idle = 3 * h * c["intermediate_size"], 0
    layers = c["num_hidden_layers"]
    total = 2 * c["vocab_size"] * h + layers * (attention + mlp + 2 * h) + h
    return total, total - layers * idle


def test_qwen3_8b_dense(tmp_path):
    shape = read_target_shape(_target(tmp_path, QWEN3_8B))
    assert shape == TargetShape(
        source=str(tmp_path / "model" / "config.json"),
        architecture="Qwen3ForCausalLM",
        model_type="qwen3",
        hidden_size=4096,
        num_layers=36,
        vocab_size=151936,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        layer_types=("full_attention",) * 36,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        num_parameters=8_190_735_360,
        num_active_parameters=8_190_735_360,
        embedding_parameters=151936 * 4096,
        num_experts=None,
        experts_per_token=None,
        vision_language=False,
        dtype="bfloat16",
    )
    assert (shape.num_parameters, shape.num_parameters) == _qwen3_count(QWEN3_8B)
    assert shape.num_parameters == pytest.approx(8.19e9, rel=0.02)  # the model card's 8.2 B
    assert read_target_shape(tmp_path / "model" / "config.json") == shape  # the file itself reads the same


def test_qwen3_30b_a3b_moe_counts_eight_of_128_experts_per_token(tmp_path):
    shape = read_target_shape(_target(tmp_path, QWEN3_30B_A3B))
    assert (shape.architecture, shape.model_type, shape.hidden_size, shape.num_layers) == (
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        2048,
        48,
    )
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (32, 4, 128)
    assert (shape.num_experts, shape.experts_per_token, shape.intermediate_size) == (128, 8, 6144)
    assert (shape.num_parameters, shape.num_active_parameters) == (30_532_122_624, 3_353_032_704)
    assert (shape.num_parameters, shape.num_active_parameters) == _qwen3_count(QWEN3_30B_A3B)
    assert shape.num_parameters == pytest.approx(30.5e9, rel=0.02)  # the model card: 30.5 B total
    assert shape.num_active_parameters == pytest.approx(3.3e9, rel=0.02)  # 3.3 B activated
    assert not shape.tie_word_embeddings and shape.embedding_parameters == 151936 * 2048


def test_qwen3_6_27b_vl_wrapper_counts_its_hybrid_text_model(tmp_path):
    """The decoder nested in text_config: 3 Gated DeltaNet layers then 1 full attention, 16 times; the vision tower
    (and the MTP layer transformers does not build) are not the text model."""
    shape = read_target_shape(_target(tmp_path, QWEN3_6_27B))
    assert shape.vision_language and shape.architecture == "Qwen3_5ForConditionalGeneration"
    assert (shape.model_type, shape.hidden_size, shape.num_layers, shape.vocab_size) == (
        "qwen3_5_text",
        5120,
        64,
        248320,
    )
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (24, 4, 256)
    assert shape.layer_types == tuple(QWEN3_6_27B_LAYERS) and shape.layer_types.count("full_attention") == 16
    assert (shape.intermediate_size, shape.max_position_embeddings, shape.dtype) == (17408, 262144, "bfloat16")
    assert not shape.tie_word_embeddings and shape.embedding_parameters == 248320 * 5120
    assert shape.num_parameters == shape.num_active_parameters == 26_895_998_464
    assert shape.num_parameters == pytest.approx(27e9, rel=0.02)  # the model card: 27 B
    assert (shape.num_experts, shape.experts_per_token) == (None, None)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "qwen3_5_vl"])
def test_counts_equal_the_real_models_parameters(kind, tiny_target_dirs):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    path = tiny_target_dirs[kind]
    shape = read_target_shape(path)
    if kind == "qwen3_5_vl":
        real = Qwen3_5ForConditionalGeneration.from_pretrained(path)
        params = {n: p for n, p in real.named_parameters() if not n.startswith("model.visual.")}
    else:
        real = AutoModelForCausalLM.from_pretrained(path)
        params = dict(real.named_parameters())
    assert shape.num_parameters == shape.num_active_parameters == sum(p.numel() for p in params.values())
    assert shape.embedding_parameters == real.get_input_embeddings().weight.numel() == TINY_VOCAB * 64
    assert (shape.num_layers, shape.hidden_size, shape.head_dim, shape.vision_language) == (
        8,
        64,
        16,
        kind == "qwen3_5_vl",
    )
    hybrid = kind.startswith("qwen3_5")
    assert (
        shape.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
        if hybrid
        else ("full_attention",) * 8
    )


def _built_on_cpu(tmp_path: Path, config) -> tuple[TargetShape, torch.nn.Module]:
    """The shape read from `config` saved alone, and the real model built from it."""
    from transformers import AutoModelForCausalLM

    config.save_pretrained(tmp_path)
    return read_target_shape(tmp_path), AutoModelForCausalLM.from_config(config)


def test_a_tied_head_is_counted_once(tmp_path):
    from transformers import Qwen3Config

    shape, real = _built_on_cpu(tmp_path, Qwen3Config(**{**TINY_CONFIG, "tie_word_embeddings": True}, head_dim=16))
    assert shape.tie_word_embeddings and shape.num_parameters == sum(p.numel() for p in real.parameters())
    every_name = sum(p.numel() for _, p in real.named_parameters(remove_duplicate=False))
    assert shape.num_parameters == every_name - TINY_VOCAB * 64  # lm_head.weight is embed_tokens.weight


def test_a_moe_with_a_dense_layer_counts_every_shared_parameter_as_active(tmp_path):
    """Layer 1 is a dense MLP (mlp_only_layers) and runs for every token; the other layers run 2 of 6 experts."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        **{**TINY_CONFIG, "num_hidden_layers": 3},
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        mlp_only_layers=[1],
    )
    shape, real = _built_on_cpu(tmp_path, config)
    total = sum(p.numel() for p in real.parameters())
    assert shape.num_parameters == total
    assert shape.num_active_parameters == total - 2 * (6 - 2) * 3 * 64 * 24  # two MoE layers, 4 idle experts each
    assert (shape.num_experts, shape.experts_per_token) == (6, 2)


@pytest.mark.parametrize("tied", [False, True])
def test_a_vl_family_without_a_causal_lm_counts_its_text_model_and_head(tmp_path, tied):
    """Qwen3-VL has no causal LM class in transformers (`Target.load` runs the image-text model): its text model
    and an LM head, tied as the wrapper's config says, equal the wrapper's parameters without the vision tower."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {
        **{k: TINY_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")},
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)
    config.save_pretrained(tmp_path)
    shape = read_target_shape(tmp_path)
    real = Qwen3VLForConditionalGeneration(config)
    assert shape.num_parameters == sum(
        p.numel() for n, p in real.named_parameters() if not n.startswith("model.visual.")
    )
    assert shape.tie_word_embeddings is tied and shape.vision_language and shape.model_type == "qwen3_vl_text"


def test_the_default_target_is_read_without_its_weights(tmp_path, monkeypatch):
    """Before conversion its config comes from the GGUF header (cleaned as the conversion cleans it); after, from the
    converted directory: the same shape either way, and nothing is written."""
    from dflashkit.target.default import default_target_dir

    converted = default_target_dir() / "config.json"
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))  # an empty cache: nothing converted
    shape = read_target_shape("default")
    assert not any(tmp_path.iterdir())
    assert (shape.source, shape.architecture, shape.model_type) == ("embedded default", "LlamaForCausalLM", "llama")
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size, shape.intermediate_size) == (30, 576, 49152, 1536)
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (9, 3, 64)
    assert shape.tie_word_embeddings and shape.embedding_parameters == 49152 * 576
    # SmolLM2-135M: embeddings (the tied head) + 30 × (attention + MLP + 2 norms) + the final norm
    layer = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert shape.num_parameters == shape.num_active_parameters == 49152 * 576 + 30 * layer + 576 == 134_515_008
    assert (shape.max_position_embeddings, shape.dtype, shape.vision_language) == (8192, "float32", False)
    monkeypatch.undo()
    if converted.is_file():  # the suite's cache holds the converted default (tests/target/test_default_target.py)
        assert read_target_shape("SmolLM2") == shape


# ------------------------------------------------------------------------------------------------- bad input
def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def _refused(target) -> str:
    with pytest.raises(TargetError) as e:
        read_target_shape(target)
    return _one_line(e)


def test_paths_that_hold_no_config(tmp_path):
    assert "does not exist" in _refused(tmp_path / "nope") and "'default'" in _refused(tmp_path / "nope")
    assert f"{tmp_path}: no config.json" in _refused(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert "is not a config.json" in _refused(tmp_path / "model.gguf")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"hidden_size": 64,', "not valid JSON (line 1"),
        ("[1, 2]", "expected a JSON object (a model config), got list"),
        (b"\xff\xfe{}", "not valid UTF-8"),
    ],
)
def test_unreadable_json_names_the_file(tmp_path, text, expected):
    file = tmp_path / "config.json"
    file.write_bytes(text if isinstance(text, bytes) else text.encode())
    line = _refused(file)
    assert line.startswith(f"{file}: ") and expected in line


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_hidden_layers": None}, "field 'num_hidden_layers' is missing"),
        ({"hidden_size": -64}, "hidden_size = -64: expected an integer ≥ 1"),
        ({"head_dim": 12.5}, "head_dim = 12.5"),
        ({"model_type": None}, "field 'model_type' is missing"),
        ({"model_type": 3}, "model_type = 3: expected the name of a model family"),
        ({"layer_types": ["full_attention"] * 3}, "transformers cannot read this config"),
    ],
)
def test_a_bad_field_is_one_line_naming_the_file_and_field(tmp_path, change, expected):
    raw = {k: v for k, v in {**QWEN3_8B, **change}.items() if v is not None}
    line = _refused(_target(tmp_path, raw))
    assert line.startswith(f"{tmp_path / 'model' / 'config.json'}: ") and expected in line, line


def test_a_vl_wrapper_names_the_nested_field(tmp_path):
    raw = {**QWEN3_6_27B, "text_config": {**QWEN3_6_27B["text_config"], "vocab_size": 0}}
    assert "text_config.vocab_size = 0: expected an integer ≥ 1" in _refused(_target(tmp_path, raw))


def test_an_unknown_architecture_suggests_remote_code_only_when_the_config_names_some(tmp_path):
    raw = {**QWEN3_8B, "model_type": "frobnicator"}
    line = _refused(_target(tmp_path, raw, "plain"))
    assert "model_type 'frobnicator' is not an architecture transformers" in line and "trust_remote_code" not in line
    own = {**raw, "auto_map": {"AutoModelForCausalLM": "modeling_frob.FrobForCausalLM"}}
    line = _refused(_target(tmp_path, own, "own"))
    assert str(tmp_path / "own" / "config.json") in line and "allow it with trust_remote_code" in line


# ------------------------------------------------------------------------------------------- check_model_dir
def test_check_model_dir_needs_the_exact_count_of_memory(tmp_path, monkeypatch):
    path = _target(tmp_path, QWEN3_8B)
    need = 8_190_735_360 * 2
    monkeypatch.setattr("dflashkit.target.files.memory_available", lambda: need)
    check_model_dir(path, bytes_per_parameter=2)  # exactly enough
    monkeypatch.setattr("dflashkit.target.files.memory_available", lambda: need - 1)
    with pytest.raises(TargetError) as e:
        check_model_dir(path, bytes_per_parameter=2)
    assert _one_line(e) == (
        f"{path / 'config.json'}: this model (hidden_size 4096, 36 layers, vocab_size 151936) needs about 16.4 GB "
        f"for its weights; this machine can allocate 16.4 GB"
    )


def test_check_model_dir_leaves_a_model_only_its_own_code_builds_to_the_loader(tmp_path, monkeypatch):
    monkeypatch.setattr("dflashkit.target.files.memory_available", lambda: 1)
    raw = {**QWEN3_8B, "model_type": "frobnicator", "auto_map": {"AutoModelForCausalLM": "m.FrobForCausalLM"}}
    check_model_dir(_target(tmp_path, raw), bytes_per_parameter=2)  # the loader runs it (trust_remote_code) or says no
    with pytest.raises(TargetError, match="hidden_size = 0"):  # its fields are still checked
        check_model_dir(_target(tmp_path, {**raw, "hidden_size": 0}, "zero"), bytes_per_parameter=2)
