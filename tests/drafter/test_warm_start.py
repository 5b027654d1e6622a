"""Warm start: drafter layers copied from the target's top decoder layers (Llama, Qwen2, Qwen3), the fc pass-through,
functional equality with the target (MLP sub-block, context K/V), refusals, checkpoint round trip, CLI, quickstart."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import TINY_CONFIG, TINY_VOCAB
from torch import nn

from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.model import DFlashDrafter, DrafterCache
from dflashkit.drafter.warm_start import default_source_layers, target_geometry, warm_start, warm_start_overrides
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target


def _memory_target(kind: str, **cfg_kw) -> Target:
    """A tiny random target built in memory (same sizes as conftest's), for architectures the fixtures lack."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    common = {**TINY_CONFIG, **cfg_kw}
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[kind]
    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32} if kind == "qwen3_moe" else {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)  # non-zero biases, so copying them is checked
    return Target(model, source=f"memory:{kind}")


@pytest.fixture(scope="module")
def targets(tiny_target_dirs) -> dict[str, Target]:
    return {
        "llama": Target.load(tiny_target_dirs["llama"]),
        "qwen3": Target.load(tiny_target_dirs["qwen3"]),
        "qwen2": _memory_target("qwen2"),
    }


def _warm_drafter(target: Target, *, layers=None, fc="last", **overrides) -> tuple[DFlashDrafter, dict]:
    overrides = {"num_hidden_layers": 2, "block_size": 4, **overrides}
    cfg = default_drafter_config(target, **warm_start_overrides(target, overrides, source_layers=layers))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    return drafter, warm_start(drafter, target, source_layers=layers, fc=fc)


def test_default_source_layers():
    assert default_source_layers([1, 8, 14, 20, 27], 2, 30) == [28, 29]  # SmolLM2, the quickstart's drafter
    assert default_source_layers([1, 8, 14, 20, 27], 5, 30) == [25, 26, 27, 28, 29]  # clipped to the top
    assert default_source_layers([1, 2, 3, 4, 5], 2, 8) == [6, 7]
    assert default_source_layers([0, 2], 3, 8) == [3, 4, 5]
    with pytest.raises(ConfigError, match="the target only 8"):
        default_source_layers([1, 2], 9, 8)


def test_target_geometry(targets):
    for name, target in targets.items():
        geo = target_geometry(target)
        assert {k: geo[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")} == {
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 96,
        }, name
        assert geo["rms_norm_eps"] == 1e-6 and geo["rope_theta"] == target.text_config.rope_parameters["rope_theta"]
        assert geo["attention_bias"] is (name == "qwen2")  # Qwen2: q/k/v biases


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_copied_tensors_equal_the_target_layers(targets, name):
    target = targets[name]
    drafter, report = _warm_drafter(target)
    assert report["source_layers"] == [6, 7] and report["fc_layer"] == 5  # ids [1..5] of an 8-layer target
    for i, idx in enumerate(report["source_layers"]):
        src, dst = target.layers[idx], drafter.layers[i]
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(dst.self_attn, part).weight, getattr(src.self_attn, part).weight)
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(dst.mlp, part).weight, getattr(src.mlp, part).weight)
        for part in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(dst, part).weight, getattr(src, part).weight)
        for part in ("q_norm", "k_norm"):
            want = getattr(src.self_attn, part).weight if name == "qwen3" else torch.ones(16)
            assert torch.equal(getattr(dst.self_attn, part).weight, want)
        if name == "qwen2":  # q/k/v biases copied; the target's o_proj has none: zero
            for part in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(getattr(dst.self_attn, part).bias, getattr(src.self_attn, part).bias)
            assert not dst.self_attn.o_proj.bias.any()
    assert torch.equal(drafter.norm.weight, target.final_norm.weight)
    assert torch.equal(drafter.hidden_norm.weight, target.layers[6].input_layernorm.weight)
    assert report["qk_norm"] == ("copied" if name == "qwen3" else "ones")
    assert drafter.config.extra["warm_start"] == report


def test_fc_modes(targets):
    target = targets["llama"]
    h = target.hidden_size
    feats = torch.randn(2, 5, 5 * h)  # (B, T, K·H), K = 5
    drafter, _ = _warm_drafter(target, fc="last")
    x = feats[..., 4 * h :]  # the deepest captured layer (5)
    torch.testing.assert_close(drafter.fc(feats), x, rtol=0, atol=0)
    torch.testing.assert_close(drafter.fuse_context(feats), target.layers[6].input_layernorm(x))
    drafter, report = _warm_drafter(target, fc="mean")
    torch.testing.assert_close(drafter.fc(feats), feats.view(2, 5, 5, h).mean(2))
    assert "fc_layer" not in report
    drafter, report = _warm_drafter(target, fc="random")
    torch.manual_seed(0)
    fresh = DFlashDrafter(drafter.config)
    assert torch.equal(drafter.fc.weight, fresh.fc.weight) and torch.equal(drafter.hidden_norm.weight, torch.ones(h))
    assert report["hidden_norm"] == "ones"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_warm_layers_compute_what_the_target_layers_compute(targets, name):
    """The MLP sub-block equals the target layer's; drafter layer 0's context K/V are the target layer's own K/V at
    the same positions (fc 'last' + hidden_norm = that layer's input norm). Keys: exact where k_norm is copied
    (Qwen3); with k_norm = ones (Llama, Qwen2) they are the target's keys scaled to RMS 1 per head."""
    target = targets[name]
    drafter, report = _warm_drafter(target)
    src = report["source_layers"]
    x = torch.randn(2, 7, target.hidden_size)
    for i, idx in enumerate(src):
        layer, mine = target.layers[idx], drafter.layers[i]
        torch.testing.assert_close(
            mine.mlp(mine.post_attention_layernorm(x)), layer.mlp(layer.post_attention_layernorm(x)), rtol=0, atol=0
        )
    ids = torch.randint(3, TINY_VOCAB, (1, 12))
    cache = target.new_cache()
    out = target.forward(ids, layer_ids=drafter.config.target_layer_ids, use_cache=True, cache=cache, logits=False)
    dcache = DrafterCache()
    with torch.no_grad():
        drafter(
            out.features,
            drafter.block_embeddings(ids[:, -1:], target.embed_weight, 4),
            context_positions=torch.arange(12)[None],
            block_positions=torch.arange(12, 16)[None],
            cache=dcache,
        )
    keys, values = cache.layers[src[0]].keys, cache.layers[src[0]].values  # (B, kvh, T, hd), after RoPE
    torch.testing.assert_close(dcache.values[0], values, rtol=1e-5, atol=1e-5)
    if name == "qwen3":
        torch.testing.assert_close(dcache.keys[0], keys, rtol=1e-5, atol=1e-5)
    else:  # RoPE rotates pairs, so it commutes with a ones-weight per-head RMSNorm
        unit = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(dcache.keys[0], unit, rtol=1e-4, atol=1e-4)


def test_refusals(targets, tiny_hybrid_dir):
    hybrid = Target.load(tiny_hybrid_dir)  # Qwen3.5: 3 × linear + 1 × full attention, twice
    with pytest.raises(ConfigError, match=r"target layer 6 .*linear-attention \(GatedDeltaNet\)"):
        _warm_drafter(hybrid)
    with pytest.raises(ConfigError, match=r"target layer 7 .*gated attention \(q_proj gives 128 = 2 × 4 heads"):
        _warm_drafter(hybrid, layers=[7], num_hidden_layers=1)
    with pytest.raises(ConfigError, match="mixture-of-experts MLP"):
        _warm_drafter(_memory_target("qwen3_moe"))
    with pytest.raises(ConfigError, match=r"MLP projections have biases \(mlp_bias\)"):
        _warm_drafter(_memory_target("llama", mlp_bias=True))
    with pytest.raises(ConfigError, match="MLP activation is 'gelu'; the drafter's MLP is SiLU"):
        _warm_drafter(_memory_target("llama", hidden_act="gelu"))
    fused = _memory_target("llama")
    fused.layers[7].self_attn.q_proj = nn.Identity()
    with pytest.raises(ConfigError, match=r"target layer 7 .*no q_proj projections found"):
        _warm_drafter(fused)
    target = targets["llama"]
    own = DFlashDrafter(default_drafter_config(target, num_hidden_layers=2))  # the drafter's own MLP 256 ≠ 96
    with pytest.raises(ConfigError, match=r"not match the target's layers \(intermediate_size 256 vs 96, rope_theta"):
        warm_start(own, target)
    with pytest.raises(ConfigError, match="must be the target's: num_attention_heads=8 given, the target has 4"):
        warm_start_overrides(target, {"num_hidden_layers": 2, "num_attention_heads": 8})
    with pytest.raises(ConfigError, match=r"fc='middle'; expected one of \['last', 'mean', 'random'\]"):
        _warm_drafter(target, fc="middle")
    with pytest.raises(ConfigError, match=r"1 source layers \[7\] for a drafter with 2 layers"):
        _warm_drafter(target, layers=[7])
    with pytest.raises(ConfigError, match=r"source layers \[8\] out of range: the target has 8 decoder layers"):
        _warm_drafter(target, layers=[7, 8])


def test_checkpoint_round_trip_keeps_the_report(targets, tmp_path):
    from dflashkit.diagnose.doctor import config_fit
    from dflashkit.diagnose.inspect_checkpoint import inspect_checkpoint, render_report

    target = targets["qwen2"]
    drafter, report = _warm_drafter(target, layers=[3, 5], fc="mean")
    save_drafter(drafter, tmp_path / "ws")
    loaded = load_drafter(tmp_path / "ws")
    assert loaded.config.extra["warm_start"] == report and report["source_layers"] == [3, 5]
    assert loaded.config == drafter.config and loaded.config.attention_bias
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert '"warm_start"' in render_report(inspect_checkpoint(tmp_path / "ws"))
    geometry = next(f for f in config_fit(loaded.config, target, 5) if f.check == "geometry")
    assert geometry.status == "OK" and "on purpose: warm-started from target layers [3, 5]" in geometry.what


def test_cli_init_drafter_warm_start(tiny_llama_dir, tmp_path, capsys):
    from dflashkit.cli import main

    out = tmp_path / "init"
    assert (
        main(
            [
                "init-drafter",
                str(out),
                "--target",
                str(tiny_llama_dir),
                "--warm-start",
                "--warm-start-layers",
                "4,7",
                "--warm-start-fc",
                "mean",
                "num_hidden_layers=2",
            ]
        )
        == 0
    )
    assert "warm start from target layers [4, 7]" in capsys.readouterr().out
    drafter = load_drafter(out)
    target = Target.load(tiny_llama_dir)
    assert drafter.config.extra["warm_start"]["fc"] == "mean" and drafter.config.intermediate_size == 96
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, target.layers[7].mlp.down_proj.weight)
    assert main(["init-drafter", str(tmp_path / "x"), "--target", str(tiny_llama_dir), "--warm-start-fc", "mean"]) == 2
    assert "only apply with --warm-start" in capsys.readouterr().err
    assert main(["info", "--target", str(tiny_llama_dir), "--drafter", str(out)]) == 0
    screen = capsys.readouterr().out
    assert "4 heads × 16, 2 kv heads (the target's: warm start)" in screen
    assert "warm start        from target layers [4, 7] (LlamaForCausalLM), fc mean" in screen


def test_quickstart_cli_flag():
    from dflashkit.cli import _parse, build_parser

    parser = build_parser()
    assert _parse(parser, ["quickstart"]).warm_start is False
    assert _parse(parser, ["quickstart", "--warm-start"]).warm_start is True
    assert _parse(parser, ["quickstart", "--no-warm-start"]).warm_start is False


def _tokens_file(path, n_rows=6):
    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(n_rows):
            ids = torch.randint(3, 40, (20,), generator=gen).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 5 + [1] * 15}) + "\n")
    return path


def test_quickstart_build_initial_drafter(targets, tmp_path):
    from dflashkit.quickstart.run import QuickstartSettings, build_initial_drafter

    target = targets["llama"]
    tokens = _tokens_file(tmp_path / "tokens.jsonl")
    cold = QuickstartSettings(draft_vocab=48, seed=3, num_hidden_layers=2)
    build_initial_drafter(target, cold, tokens, tmp_path / "cold")
    # warm_start=False is unchanged: the same config and tensors as a seeded fresh drafter (vocab map aside)
    cfg = default_drafter_config(target, num_hidden_layers=2, block_size=4, draft_vocab_size=48)
    torch.manual_seed(3)
    reference = DFlashDrafter(cfg)
    a = load_drafter(tmp_path / "cold")
    assert a.config == cfg and "warm_start" not in a.config.extra
    for key, value in reference.state_dict().items():
        if key != "draft_to_target":
            assert torch.equal(a.state_dict()[key], value), key
    assert (a.draft_to_target.diff() > 0).all() and set(range(3, 40)) <= set(a.draft_to_target.tolist())

    warm = QuickstartSettings(draft_vocab=48, seed=3, num_hidden_layers=2, warm_start=True)
    assert warm.drafter_overrides(target)["intermediate_size"] == 96
    with pytest.raises(ConfigError, match="drafter_overrides\\(target\\)"):
        warm.drafter_overrides()
    build_initial_drafter(target, warm, tokens, tmp_path / "warm")
    b = load_drafter(tmp_path / "warm")
    assert b.config.extra["warm_start"]["source_layers"] == [6, 7] and b.config.draft_vocab_size == 48
    for i, idx in enumerate((6, 7)):
        for key, value in target.layers[idx].state_dict().items():
            assert torch.equal(b.layers[i].state_dict()[key], value), (i, key)
    assert torch.equal(b.draft_to_target, a.draft_to_target)  # the reduced vocabulary is kept
    torch.manual_seed(3)
    assert torch.equal(b.mask_embedding, DFlashDrafter(b.config).mask_embedding)  # not copied: the seed's init
    with torch.no_grad():  # and it drafts in that vocabulary
        feats = target.forward(torch.randint(3, 40, (1, 9)), layer_ids=b.config.target_layer_ids, logits=False).features
        hidden = b(
            feats,
            b.block_embeddings(torch.tensor([[5]]), target.embed_weight, 4),
            context_positions=torch.arange(9)[None],
            block_positions=torch.arange(9, 13)[None],
        )
    assert b.logits(hidden, target.lm_head_weight).shape == (1, 4, 48)

    full = QuickstartSettings(
        draft_vocab=0, seed=3, num_hidden_layers=2, warm_start=True
    )  # full vocabulary: still warm-started
    assert build_initial_drafter(target, full, tokens, tmp_path / "full") == 1.0
    c = load_drafter(tmp_path / "full")
    assert c.config.draft_vocab_size is None and torch.equal(
        c.layers[1].mlp.up_proj.weight, target.layers[7].mlp.up_proj.weight
    )


def test_real_smollm2_default_target():
    """The embedded SmolLM2 (only when already built in the cache: building it takes ~30 s)."""
    from dflashkit.quickstart.run import QuickstartSettings
    from dflashkit.target.default import default_target_dir

    if not (default_target_dir() / "model.safetensors").is_file():
        pytest.skip("the default target is not built in this cache")
    t0 = time.perf_counter()
    target = Target.load("default")
    s = QuickstartSettings(num_hidden_layers=2, warm_start=True)
    overrides = s.drafter_overrides(target)
    assert {
        k: overrides[k]
        for k in (
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "rope_theta",
            "attention_bias",
        )
    } == {
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "rope_theta": 100000.0,
        "attention_bias": False,
    }
    assert abs(overrides["rms_norm_eps"] - 1e-5) < 1e-9
    cfg = default_drafter_config(target, **overrides)
    assert cfg.target_layer_ids == [1, 8, 14, 20, 27]
    drafter = DFlashDrafter(cfg)
    report = warm_start(drafter, target)
    assert report["source_layers"] == [28, 29] and report["fc_layer"] == 27
    assert torch.equal(drafter.layers[1].self_attn.k_proj.weight, target.layers[29].self_attn.k_proj.weight)
    assert time.perf_counter() - t0 < 30
