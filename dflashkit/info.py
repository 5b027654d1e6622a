"""`dflashkit info`: what the target is, which drafter dflashkit would build for it, and where files live.

Also home of `default_drafter_config(target)`, the one place that turns a loaded target into a DrafterConfig.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields
from pathlib import Path
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

    The mask token is a spare embedding row when the target has one (z-lab's choice for Qwen3), else the row of
    a special token no chat produces (SmolLM2: 16 `<empty_output>`; `mask_choice.py`; measured as good as a
    learned mask at equal training minutes, README "Mask choice"), else a learned mask embedding stored in the
    drafter. `learned_mask_embedding=True` asks for the learned one.
    """
    valid = {f.name for f in fields(DrafterConfig)} | {"num_features"}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"unknown drafter config field(s) {unknown}; valid fields: {sorted(valid)}")
    overrides = dict(overrides)
    spare = target.spare_mask_token_id()
    if overrides.pop("learned_mask_embedding", False):
        mask, why = None, "a learned mask embedding was asked for"
    elif "mask_token_id" in overrides:
        mask, why = overrides.pop("mask_token_id"), "chosen by the user"
    elif spare is not None:
        mask, why = spare, f"spare embedding row {spare}: beyond the tokenizer, never produced"
    else:
        from dflashkit.mask_choice import unused_special_token

        pick = unused_special_token(target.tokenizer) if target.tokenizer is not None else None
        mask, why = pick if pick else (None, "every embedding row is a token the tokenizer can produce")
    extra = {"chat_template": target.chat_template_info(), "target_architecture": target.architecture,
             "mask_reason": why}
    extra.update(overrides.pop("extra", {}) or {})
    cfg = DrafterConfig.for_target(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                   num_target_layers=target.num_layers, mask_token_id=mask, extra=extra, **overrides)
    target.check_layer_ids(cfg.target_layer_ids)
    return cfg


def describe_mask(cfg: DrafterConfig, tokenizer: Any = None) -> str:
    """Which mask the drafter uses, why (as recorded at creation), and where it loads unchanged."""
    why = cfg.extra.get("mask_reason")
    if cfg.learned_mask_embedding:
        text = "learned mask embedding (the drafter's own vector"
        text += f"; {why})" if why else ")"
        return text + (f" — vLLM reads it (mask_embedding.pt), llama.cpp only with a table copy in the GGUF; "
                       f"z-lab and SGLang would use row {cfg.mask_token_id} instead")
    kind, token = "", None
    if tokenizer is not None:
        n = len(tokenizer)
        if cfg.mask_token_id >= n:
            kind = "beyond the tokenizer: never produced"
        else:
            token = tokenizer.convert_ids_to_tokens(cfg.mask_token_id)
            special = (cfg.mask_token_id in set(getattr(tokenizer, "all_special_ids", []) or [])
                       or cfg.mask_token_id in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
            kind = f"{token!r}, {'a special token' if special else 'an ordinary token'}"
    if why and token is not None and repr(token) in why:
        parts = [why]                      # the recorded reason already names the token
    else:
        parts = [p for p in (kind, why) if p]
    return (f"target embedding row {cfg.mask_token_id}" + (f" ({'; '.join(parts)})" if parts else "")
            + " — loads unchanged in z-lab, vLLM, SGLang and llama.cpp")


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def gather_info(target_spec: str | None, *, drafter: str | None = None, device: str = "cpu",
                trust_remote_code: bool = False) -> dict[str, Any]:
    from dflashkit.checkpoint import CONFIG_NAME, describe, load_drafter
    from dflashkit.config import stores_target_layer_ids
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
        raw = json.loads((Path(drafter) / CONFIG_NAME).read_text())  # load_drafter has parsed it already
        drafter_info = {"source": drafter, **describe(drafter),
                        "target_layer_ids_derived": not stores_target_layer_ids(raw)}
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
                    "mask": describe_mask(cfg, target.tokenizer)},
        "cache": {"root": str(cache_root()), "default_target": str(default_target_dir())},
    }


def render_info(info: dict[str, Any]) -> str:
    t, d, c = info["target"], info["drafter"], info["cache"]
    cfg = d["config"]
    att = t["attention"]
    from dflashkit.warm_start import describe as describe_warm_start
    warm = describe_warm_start((cfg["dflash_config"].get("dflashkit") or {}).get("warm_start"))
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
        f"{cfg['num_key_value_heads']} kv heads " + ("(the target's: warm start)" if warm else "(own geometry)"),
        f"  MLP               {cfg['intermediate_size']}",
        f"  target features   {len(cfg['dflash_config']['target_layer_ids'])} layers "
        f"{cfg['dflash_config']['target_layer_ids']} → fc {len(cfg['dflash_config']['target_layer_ids']) * cfg['hidden_size']}"
        f" → {cfg['hidden_size']}"
        + (" (derived by z-lab's default rule: config.json stores none)" if d.get("target_layer_ids_derived") else ""),
        f"  block size        {cfg['block_size']}",
        f"  mask token        {d['mask']}",
        f"  parameters        {_count(d['parameters'])} (+ the target's frozen embeddings and LM head)",
        *([f"  warm start        {warm}"] if warm else []),
        "",
        "Cache",
        f"  root              {c['root']}  (set DFLASHKIT_CACHE to move it)",
        f"  default target    {c['default_target']}",
    ]
    return "\n".join(lines)


__all__ = ["default_drafter_config", "describe_mask", "gather_info", "parse_overrides", "render_info"]
