"""Drafter checkpoints built by hand for tests: a small dflashkit drafter for the conftest tiny targets (hidden 64,
vocab 97, 8 layers), optionally with a wrong fc width or edited tensors, and a speculators-format checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflashkit.drafter.checkpoint import drafter_state_dict
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter


def small_config(**changes) -> DrafterConfig:
    """A drafter that fits the conftest tiny targets (hidden 64, vocab 97, 8 layers)."""
    base = dict(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=[1, 2, 3, 4, 5],
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        block_size=4,
        learned_mask_embedding=True,
        extra={
            "chat_template": {"present": False, "thinking_switch": False},
            "target_architecture": "LlamaForCausalLM",
        },
    )
    base.update(changes)
    return DrafterConfig(**base)


def write_checkpoint(
    path: Path,
    cfg: DrafterConfig,
    *,
    fc_features: int | None = None,
    seed: int = 0,
    edit: Callable[[dict], None] | None = None,
) -> Path:
    """Save a drafter as dflashkit does, optionally with an fc over `fc_features` layers or edited tensors."""
    torch.manual_seed(seed)
    sd = drafter_state_dict(DFlashDrafter(cfg))
    if fc_features is not None:
        sd["fc.weight"] = torch.randn(cfg.hidden_size, fc_features * cfg.hidden_size) * 0.02
    if edit is not None:
        edit(sd)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    cfg.save(path / "config.json")
    return path


def speculators_checkpoint(path, *, draft_vocab: int | None = None, extra_keys: dict | None = None, **config):
    """A speculators-format DFlash checkpoint built by hand (config fields as DFlashSpeculatorConfig saves them)."""
    tl = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "vocab_size": 97,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
    }
    raw = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.3.0",
        "transformer_layer_config": tl,
        "draft_vocab_size": draft_vocab or 97,
        "block_size": 8,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [2, 4, 6],
        "mask_token_id": 90,
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7}],
            "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]},
        },
    }
    raw.update(config)
    ours = DrafterConfig(
        hidden_size=64,
        vocab_size=97,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        block_size=8,
        mask_token_id=90,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    sd = {k: v.clone() for k, v in drafter_state_dict(DFlashDrafter(ours)).items()}
    tables = {"embed_tokens.weight": torch.randn(97, 64), "verifier_norm.weight": torch.ones(64)}
    if draft_vocab:
        ids = torch.tensor(sorted(torch.randperm(97)[:draft_vocab].tolist()))
        t2d = torch.zeros(97, dtype=torch.bool)
        t2d[ids] = True
        tables.update(d2t=ids - torch.arange(draft_vocab), t2d=t2d, **{"lm_head.weight": torch.randn(draft_vocab, 64)})
    tables.update(extra_keys or {})
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file({**sd, **tables}, str(path / "model.safetensors"))
    return path, sd, tables
