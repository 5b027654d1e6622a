"""z-lab checkpoints: bit-exact round trip, strict loading of a hand-built z-lab state dict, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflashkit.drafter.checkpoint import drafter_state_dict, load_drafter, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, TargetError

# The field set of z-lab's Qwen3-8B-DFlash-b16 config.json (values as published), used at full size on meta.
ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def zlab_small_config() -> dict:
    cfg = dict(ZLAB_QWEN3_8B)
    cfg.update(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=200,
        num_hidden_layers=2,
        layer_types=["full_attention"] * 2,
        dflash_config={"mask_token_id": 150, "target_layer_ids": [1, 3, 5]},
        num_target_layers=8,
    )
    return cfg


def zlab_state_dict(cfg: dict, n_features: int | None = None) -> dict[str, torch.Tensor]:
    """Tensors named and shaped exactly as z-lab's DFlashDraftModel saves them, built by hand."""
    h, hd, nh, kv, inter = (
        cfg[k] for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    )
    k = n_features or len(cfg["dflash_config"]["target_layer_ids"])
    sd = {"fc.weight": torch.randn(h, k * h), "hidden_norm.weight": torch.randn(h), "norm.weight": torch.randn(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sd.update(
            {
                p + "input_layernorm.weight": torch.randn(h),
                p + "post_attention_layernorm.weight": torch.randn(h),
                p + "self_attn.q_proj.weight": torch.randn(nh * hd, h),
                p + "self_attn.k_proj.weight": torch.randn(kv * hd, h),
                p + "self_attn.v_proj.weight": torch.randn(kv * hd, h),
                p + "self_attn.o_proj.weight": torch.randn(h, nh * hd),
                p + "self_attn.q_norm.weight": torch.randn(hd),
                p + "self_attn.k_norm.weight": torch.randn(hd),
                p + "mlp.gate_proj.weight": torch.randn(inter, h),
                p + "mlp.up_proj.weight": torch.randn(inter, h),
                p + "mlp.down_proj.weight": torch.randn(h, inter),
            }
        )
    return sd


def write_zlab(path, cfg, sd):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return path


def test_round_trip_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=32,
        vocab_size=64,
        num_target_layers=6,
        target_layer_ids=[0, 2, 4],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        block_size=8,
        learned_mask_embedding=True,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        extra={"chat_template": {"present": True}},
    )
    drafter = DFlashDrafter(cfg)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config == cfg
    a, b = drafter_state_dict(drafter), drafter_state_dict(loaded)
    assert a.keys() == b.keys() and "mask_embedding" in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and saving again gives identical bytes
    save_drafter(loaded, tmp_path / "again")
    assert (tmp_path / "ckpt/model.safetensors").read_bytes() == (tmp_path / "again/model.safetensors").read_bytes()


def test_hand_built_zlab_checkpoint_loads_strictly(tmp_path):
    cfg = zlab_small_config()
    sd = zlab_state_dict(cfg)
    drafter = load_drafter(write_zlab(tmp_path / "z", cfg, sd))
    assert drafter.config.target_layer_ids == [1, 3, 5] and drafter.config.mask_token_id == 150
    assert not drafter.config.learned_mask_embedding
    own = drafter.state_dict()
    for k, v in sd.items():
        assert torch.equal(own[k], v), k


def test_full_size_zlab_config_parses():
    cfg = DrafterConfig.from_zlab_dict(ZLAB_QWEN3_8B)
    assert (cfg.hidden_size, cfg.num_features, cfg.block_size, cfg.mask_token_id) == (4096, 5, 16, 151669)
    with torch.device("meta"):
        d = DFlashDrafter(cfg)
    assert tuple(d.fc.weight.shape) == (4096, 20480)
    assert tuple(d.layers[0].self_attn.q_proj.weight.shape) == (4096, 4096)
    # our own config.json carries every field z-lab's does (except hub/tokenizer bookkeeping)
    ours = cfg.to_zlab_dict()
    skip = {"auto_map", "bos_token_id", "eos_token_id", "dtype", "transformers_version", "rope_scaling"}
    assert set(ZLAB_QWEN3_8B) - skip <= set(ours)


def test_four_of_five_fc_is_a_named_shape_error(tmp_path):
    cfg = zlab_small_config()
    cfg["dflash_config"] = {"mask_token_id": 150, "target_layer_ids": [1, 2, 3, 4, 5]}
    sd = zlab_state_dict(cfg, n_features=4)
    with pytest.raises(CheckpointError, match=r"'fc.weight'.*\[32, 128\].*expected \[32, 160\].*reads 4 target layers"):
        load_drafter(write_zlab(tmp_path / "z", cfg, sd))


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    cfg = zlab_small_config()
    sd = zlab_state_dict(cfg)
    del sd["norm.weight"], sd["layers.1.mlp.up_proj.weight"]
    sd["lm_head.weight"] = torch.randn(200, 32)
    with pytest.raises(
        CheckpointError,
        match=r"missing keys \['layers.1.mlp.up_proj.weight', 'norm.weight'\]; "
        r"unexpected keys \['lm_head.weight'\]",
    ):
        load_drafter(write_zlab(tmp_path / "z", cfg, sd))


def test_bad_config_files(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    with pytest.raises(CheckpointError, match=r"no config.json"):
        load_drafter(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON \(line 1"):
        load_drafter(d)
    cfg = zlab_small_config()
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="required field 'hidden_size' is missing"):
        load_drafter(d)
    cfg = zlab_small_config()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"no model.safetensors"):
        load_drafter(d)
    (d / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_drafter(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "missing")


def test_drafter_must_fit_target(tiny_llama_dir):
    from dflashkit.target.model import Target, check_drafter_fits

    target = Target.load(tiny_llama_dir)  # hidden 64, vocab 97, 8 layers
    good = DrafterConfig(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=[1, 4],
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        mask_token_id=5,
    )
    check_drafter_fits(good, target)
    with pytest.raises(TargetError, match="hidden_size 32 ≠ the target's hidden size 64"):
        check_drafter_fits(good.replace(hidden_size=32), target)
    with pytest.raises(TargetError, match="vocab_size"):
        check_drafter_fits(good.replace(vocab_size=120, mask_token_id=5), target)
    with pytest.raises(TargetError, match="num_target_layers"):
        check_drafter_fits(good.replace(num_target_layers=12, target_layer_ids=[1, 10]), target)


def test_zlab_config_without_target_layer_ids_derives_them(tmp_path, tiny_llama_dir, capsys):
    """z-lab's fallback: build_target_layer_ids(num_target_layers, num_hidden_layers) when dflash_config has no
    target_layer_ids; inspect and info say the ids were derived, not stored."""
    from dflashkit.diagnose.info import gather_info, render_info
    from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint, render_report

    full = dict(ZLAB_QWEN3_8B, dflash_config={"mask_token_id": 151669})  # 36 target layers, 5 drafter layers
    assert DrafterConfig.from_zlab_dict(full).target_layer_ids == [1, 9, 17, 25, 33]  # the published ids
    cfg = zlab_small_config()
    cfg.update(hidden_size=64, vocab_size=97, head_dim=16, dflash_config={"mask_token_id": 5})
    sd = zlab_state_dict(cfg, n_features=2)  # K = num_hidden_layers = 2 → round(1 + j·(8 − 4)/1) = [1, 5]
    path = write_zlab(tmp_path / "z", cfg, sd)
    drafter = load_drafter(path)
    assert drafter.config.target_layer_ids == [1, 5] and drafter.config.num_features == 2
    report = inspect_checkpoint(path)
    assert report.facts["target_layer_ids_derived"] and report.facts["target_layer_ids"] == [1, 5]
    text = render_report(report)
    assert "derived" in text and "config stores none" in text
    assert not [f for f in report.findings if f.status == "FAIL"]
    info = gather_info(str(tiny_llama_dir), drafter=str(path))
    assert info["drafter"]["target_layer_ids_derived"] and "derived" in render_info(info)
    # ids that are stored are reported as stored
    stored = inspect_checkpoint(write_zlab(tmp_path / "s", zlab_small_config(), zlab_state_dict(zlab_small_config())))
    assert not stored.facts["target_layer_ids_derived"] and "derived" not in render_report(stored)
    # nothing to derive them from
    del cfg["num_target_layers"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="neither 'target_layer_ids' nor 'num_target_layers'"):
        load_drafter(path)


def test_non_finite_or_integer_weights_are_never_saved_loaded_or_exported(tmp_path, capsys):
    """A drafter of inf/NaN weights is never written (save_drafter), loaded for use, or converted; a float weight
    stored as integers is refused instead of being cast without a word."""
    from dflashkit.cli import main
    from helpers.checkpoints import small_config, write_checkpoint

    cfg = small_config()
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        drafter.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.mlp.up_proj.weight' holds 1 non-finite"):
        save_drafter(drafter, tmp_path / "nan")
    assert not (tmp_path / "nan").exists()

    def poison(sd):
        sd["norm.weight"][3] = float("inf")

    bad = write_checkpoint(tmp_path / "inf", cfg, edit=poison)
    with pytest.raises(CheckpointError, match=r"inf: tensor 'norm.weight' holds 1 non-finite"):
        load_drafter(bad)
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert "holds 1 non-finite" in capsys.readouterr().err and not (tmp_path / "out").exists()

    def as_int(sd):
        sd["fc.weight"] = torch.zeros_like(sd["fc.weight"], dtype=torch.int64)

    ints = write_checkpoint(tmp_path / "int", cfg, edit=as_int)
    with pytest.raises(CheckpointError, match=r"tensor 'fc.weight' has dtype int64; expected a floating-point tensor"):
        load_drafter(ints)
