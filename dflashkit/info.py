"""`dflashkit info`: what the target is, which drafter dflashkit would build for it, and where files live.

Also home of `default_drafter_config(target)`, the one place that turns a loaded target into a DrafterConfig.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

import yaml

from dflashkit.config import DrafterConfig
from dflashkit.errors import ConfigError


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """`key=value` strings → dict; values parsed as YAML scalars/lists (e.g. `target_layer_ids=[1,5,9]`)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


def default_drafter_config(target: Any, **overrides: Any) -> DrafterConfig:
    """The drafter dflashkit builds for `target` (a `Target`): own geometry, z-lab layer ids, mask-token choice.

    The mask token is a spare embedding row when the target has one (z-lab's choice for Qwen3), else a learned
    mask embedding stored in the drafter (SmolLM2 uses all 49152 rows).
    """
    valid = {f.name for f in fields(DrafterConfig)} | {"num_features"}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"unknown drafter config field(s) {unknown}; valid fields: {sorted(valid)}")
    overrides = dict(overrides)
    mask = overrides.pop("mask_token_id", target.spare_mask_token_id())
    extra = {"chat_template": target.chat_template_info(), "target_architecture": target.architecture}
    extra.update(overrides.pop("extra", {}) or {})
    cfg = DrafterConfig.for_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                   num_target_layers=target.num_layers, mask_token_id=mask, extra=extra, **overrides)
    target.check_layer_ids(cfg.target_layer_ids)
    return cfg


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def gather_info(target_spec: str | None, *, drafter: str | None = None, device: str = "cpu",
                trust_remote_code: bool = False) -> dict[str, Any]:
    from dflashkit.checkpoint import describe, load_drafter
    from dflashkit.default_target import DEFAULT_ALIASES, cache_root, default_target_dir
    from dflashkit.model import DFlashDrafter
    from dflashkit.target import Target

    is_default = target_spec is None or str(target_spec).lower() in DEFAULT_ALIASES
    was_cached = is_default and (default_target_dir() / "model.safetensors").is_file()
    t0 = time.perf_counter()
    target = Target.load(target_spec, device=device, trust_remote_code=trust_remote_code)
    load_s = time.perf_counter() - t0
    if drafter:
        model = load_drafter(drafter)
        cfg = model.config
        drafter_info = {"source": drafter, **describe(drafter)}
    else:
        cfg = default_drafter_config(target)
        model = DFlashDrafter(cfg)
        drafter_info = {"source": "default for this target (untrained)"}
    tcfg = target.text_config
    return {
        "target": {
            "source": target.source, "architecture": target.architecture, "num_layers": target.num_layers,
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "tokenizer_size": len(target.tokenizer) if target.tokenizer is not None else None,
            "attention": {"heads": getattr(tcfg, "num_attention_heads", None),
                          "kv_heads": getattr(tcfg, "num_key_value_heads", None),
                          "head_dim": getattr(tcfg, "head_dim", None)},
            "hybrid": target.is_hybrid, "linear_attention_backend": target.linear_attention_backend(),
            "chat_template": target.chat_template_info(), "parameters": target.parameter_count(),
            "dtype": str(target.dtype).replace("torch.", ""), "device": str(target.device),
            "load_seconds": round(load_s, 2), "converted_now": is_default and not was_cached,
        },
        "drafter": {**drafter_info, "config": cfg.to_zlab_dict(), "parameters": model.num_parameters(),
                    "mask": ("learned mask embedding (no spare embedding row)" if cfg.learned_mask_embedding
                             else f"target embedding row {cfg.mask_token_id}")},
        "cache": {"root": str(cache_root()), "default_target": str(default_target_dir())},
    }


def render_info(info: dict[str, Any]) -> str:
    t, d, c = info["target"], info["drafter"], info["cache"]
    cfg = d["config"]
    att = t["attention"]
    lines = [
        "Target",
        f"  source            {t['source']}",
        f"  architecture      {t['architecture']}  ({'hybrid: ' + str(t['linear_attention_backend']) if t['hybrid'] else 'dense'})",
        f"  layers / hidden   {t['num_layers']} / {t['hidden_size']}",
        f"  attention         {att['heads']} heads × {att['head_dim']}, {att['kv_heads']} kv heads",
        f"  vocabulary        {t['vocab_size']} embedding rows (tokenizer {t['tokenizer_size']})",
        f"  chat template     {'present' if t['chat_template']['present'] else 'absent'}"
        + (", thinking switch" if t['chat_template']['thinking_switch'] else ""),
        f"  parameters        {_count(t['parameters'])} ({t['dtype']} on {t['device']})",
        f"  load time         {t['load_seconds']} s" + (" (first use: converted from GGUF)" if t["converted_now"] else ""),
        "",
        f"Drafter ({d['source']})",
        f"  layers            {cfg['num_hidden_layers']} × {cfg['layer_types'][0]}"
        + (f", sliding window {cfg['sliding_window']}" if cfg.get("use_sliding_window") else ""),
        f"  attention         {cfg['num_attention_heads']} heads × {cfg['head_dim']}, "
        f"{cfg['num_key_value_heads']} kv heads (own geometry)",
        f"  MLP               {cfg['intermediate_size']}",
        f"  target features   {len(cfg['dflash_config']['target_layer_ids'])} layers "
        f"{cfg['dflash_config']['target_layer_ids']} → fc {len(cfg['dflash_config']['target_layer_ids']) * cfg['hidden_size']}"
        f" → {cfg['hidden_size']}",
        f"  block size        {cfg['block_size']}",
        f"  mask token        {d['mask']}",
        f"  parameters        {_count(d['parameters'])} (+ the target's frozen embeddings and LM head)",
        "",
        "Cache",
        f"  root              {c['root']}  (set DFLASHKIT_CACHE to move it)",
        f"  default target    {c['default_target']}",
    ]
    return "\n".join(lines)


__all__ = ["default_drafter_config", "gather_info", "parse_overrides", "render_info"]
