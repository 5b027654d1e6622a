"""`dflashkit info`: what the target is, which drafter dflashkit would build for it, and where files live.

The drafter it describes comes from `dflashkit.drafter.defaults.default_drafter_config(target)`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dflashkit.cpu_products.choice import Choice
from dflashkit.cpu_products.compile_choice import MeasuredCompile
from dflashkit.data.regenerate_compile import REGENERATE_COMPILE
from dflashkit.drafter.defaults import default_drafter_config, describe_mask
from dflashkit.errors import ConfigError
from dflashkit.evaluate.decode_compile import DECODE_COMPILE
from dflashkit.features.capture_compile import CAPTURE_COMPILE
from dflashkit.features.capture_precision import CAPTURE
from dflashkit.train.compile_choice import TRAIN_COMPILE
from dflashkit.train.precision_choice import TRAINING


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def gather_info(
    target_spec: str | None, *, drafter: str | None = None, device: str = "cpu", trust_remote_code: bool = False
) -> dict[str, Any]:
    from dflashkit.drafter.checkpoint import CONFIG_NAME, describe, load_drafter
    from dflashkit.drafter.config import stores_target_layer_ids
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.io_utils import cache_root
    from dflashkit.target.default import DEFAULT_ALIASES, default_target_dir
    from dflashkit.target.model import Target

    is_default = target_spec is None or str(target_spec).lower() in DEFAULT_ALIASES
    was_cached = is_default and (default_target_dir() / "model.safetensors").is_file()
    t0 = time.perf_counter()
    target = Target.load(target_spec, device=device, trust_remote_code=trust_remote_code)
    load_s = time.perf_counter() - t0
    if drafter:
        model = load_drafter(drafter)
        cfg = model.config
        raw = json.loads((Path(drafter) / CONFIG_NAME).read_text())  # load_drafter has parsed it already
        drafter_info = {
            "source": drafter,
            **describe(drafter),
            "target_layer_ids_derived": not stores_target_layer_ids(raw),
        }
    else:
        cfg = default_drafter_config(target)
        model = DFlashDrafter(cfg)
        drafter_info = {"source": "default for this target (untrained)"}
    tcfg = target.text_config
    return {
        "target": {
            "source": target.source,
            "architecture": target.architecture,
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
            "tokenizer_size": len(target.tokenizer) if target.tokenizer is not None else None,
            "attention": {
                "heads": getattr(tcfg, "num_attention_heads", None),
                "kv_heads": getattr(tcfg, "num_key_value_heads", None),
                "head_dim": getattr(tcfg, "head_dim", None),
            },
            "hybrid": target.is_hybrid,
            "linear_attention_backend": target.linear_attention_backend(),
            "chat_template": target.chat_template_info(),
            "parameters": target.parameter_count(),
            "dtype": str(target.dtype).replace("torch.", ""),
            "device": str(target.device),
            # None: its decoding passes may run as compiled whole layers (a timed candidate); else why they cannot
            "compiled_layers_refused": _compiled_layers_refused(target),
            "load_seconds": round(load_s, 2),
            "converted_now": is_default and not was_cached,
        },
        "drafter": {
            **drafter_info,
            "config": cfg.to_zlab_dict(),
            "parameters": model.num_parameters(),
            "mask": describe_mask(cfg, target.tokenizer),
        },
        "cache": {"root": str(cache_root()), "default_target": str(default_target_dir())},
        "machine": _machine(),
    }


def _compiled_layers_refused(target: Any) -> str | None:
    """None when the target's decoding passes can run as compiled whole layers (target/native_layers.py), else why
    not."""
    from dflashkit.target.native_layers import LayerPlan

    return None if target.native_layers is not None else LayerPlan.why_not(target.text_model)


def _machine() -> dict[str, Any]:
    """The CPU, its BLAS, and the decoding products chosen on it so far (measured at first use, then kept)."""
    from dflashkit.cpu_products.choice import DAY, max_age_seconds
    from dflashkit.cpu_products.machine import describe_machine
    from dflashkit.cpu_products.native_rows import status as native_status
    from dflashkit.cpu_products.packed_weights import budget_bytes
    from dflashkit.cpu_products.products import CANDIDATES, FUSED, LAYERS, NATIVE, PACKED, mode
    from dflashkit.cpu_products.report import choices_by_rows, choices_report

    report = choices_report()
    stamps = [e["measured_at"] for e in report["choices"].values() if isinstance(e.get("measured_at"), int | float)]
    return {
        **describe_machine(),
        "products_mode": mode(),
        "products_candidates": [
            *CANDIDATES,
            *([f"{FUSED} (the target's layers)"] if "onednn" in CANDIDATES else []),
            *([f"{LAYERS} (a Llama-family target's layers)"] if NATIVE in CANDIDATES else []),
        ],
        "products_packed_budget_gib": round(budget_bytes() / (1 << 30), 2) if PACKED in CANDIDATES else None,
        "products_native": native_status(),  # built now if this machine has none yet (~2 s, once)
        "products_store": report["store"],
        "products_max_age_days": max_age_seconds() / DAY,
        "products_oldest_days": round((time.time() - min(stamps)) / DAY, 2) if stamps else None,
        "products_by_rows": {str(k): v for k, v in choices_by_rows(report).items()},
        **_measured_precision("train", TRAINING),
        **_measured_precision("capture", CAPTURE),
        **_measured_compile("train", TRAIN_COMPILE),
        **_measured_compile("capture", CAPTURE_COMPILE),
        **_measured_compile("regenerate", REGENERATE_COMPILE),
        **_measured_compile("decode", DECODE_COMPILE),
    }


def _measured_compile(name: str, kind: MeasuredCompile) -> dict[str, Any]:
    """Whether `name`'s steps (training steps, capture forwards) run through torch.compile here under `auto`: forced
    by the environment, or the trials so far on this machine, by key (cpu_products.compile_choice)."""
    try:
        forced = kind.forced()
    except ConfigError as e:
        forced = f"invalid: {e}"
    path = kind.store_path()
    fields = ("choice", "eager_ms", "compiled_ms", "compile_s", "unusable")
    return {
        f"{name}_compile_forced": forced and kind.choice.why(forced),
        f"{name}_compile_store": str(path) if path is not None else None,
        f"{name}_compile_unit": kind.unit,
        f"{name}_compile_by_key": {k: {x: e[x] for x in fields if x in e} for k, e in kind.stored_choices().items()},
    }


def _measured_precision(name: str, kind: Choice) -> dict[str, Any]:
    """The precision CPU runs of `name` (training under dtype: auto, capture under --precision auto) take here:
    forced by the environment, or the choices timed so far on this machine, by key (cpu_products.choice)."""
    try:
        forced = kind.override()
    except ConfigError as e:
        forced = f"invalid: {e}"
    store = kind.store()
    fields = ("choice", "fp32_ms", "bf16_ms")
    stored = store.read(kind.usable_entry(kind.values)) if store is not None else {}
    return {
        f"{name}_precision_forced": forced and kind.why(forced),
        f"{name}_precision_store": str(store.path) if store is not None else None,
        f"{name}_precision_by_key": {k: {x: e.get(x) for x in fields} for k, e in stored.items()},
    }


def render_info(info: dict[str, Any]) -> str:
    t, d, c = info["target"], info["drafter"], info["cache"]
    cfg = d["config"]
    att = t["attention"]
    from dflashkit.drafter.warm_start import describe as describe_warm_start

    warm = describe_warm_start((cfg["dflash_config"].get("dflashkit") or {}).get("warm_start"))
    kind = f"hybrid: {t['linear_attention_backend']}" if t["hybrid"] else "dense"
    ids = cfg["dflash_config"]["target_layer_ids"]
    lines = [
        "Target",
        f"  source            {t['source']}",
        f"  architecture      {t['architecture']}  ({kind})",
        f"  layers / hidden   {t['num_layers']} / {t['hidden_size']}",
        f"  attention         {att['heads']} heads × {att['head_dim']}, {att['kv_heads']} kv heads",
        f"  vocabulary        {t['vocab_size']} embedding rows (tokenizer {t['tokenizer_size']})",
        f"  chat template     {'present' if t['chat_template']['present'] else 'absent'}"
        + (", thinking switch" if t["chat_template"]["thinking_switch"] else ""),
        f"  parameters        {_count(t['parameters'])} ({t['dtype']} on {t['device']})",
        "  compiled layers   "
        + (
            "a candidate of its decoding passes (native_layers, timed at first use)"
            if t["compiled_layers_refused"] is None
            else f"no ({t['compiled_layers_refused']}): its layers run as transformers computes them"
        ),
        f"  load time         {t['load_seconds']} s"
        + (" (first use: converted from GGUF)" if t["converted_now"] else ""),
        "",
        f"Drafter ({d['source']})",
        f"  layers            {cfg['num_hidden_layers']} × {cfg['layer_types'][0]}"
        + (f", sliding window {cfg['sliding_window']}" if cfg.get("use_sliding_window") else ""),
        f"  attention         {cfg['num_attention_heads']} heads × {cfg['head_dim']}, "
        f"{cfg['num_key_value_heads']} kv heads " + ("(the target's: warm start)" if warm else "(own geometry)"),
        f"  MLP               {cfg['intermediate_size']}",
        f"  target features   {len(cfg['dflash_config']['target_layer_ids'])} layers "
        f"{ids} → fc {len(ids) * cfg['hidden_size']}"
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
        "",
        *_machine_lines(info["machine"]),
    ]
    return "\n".join(lines)


def _machine_lines(m: dict[str, Any]) -> list[str]:
    flags = f" ({', '.join(m['flags'])})" if m["flags"] else ""
    rows = m["products_by_rows"]
    if m["products_mode"] != "auto":
        chosen = f"{m['products_mode']} everywhere (products={m['products_mode']} in DFLASHKIT_CHOICES)"
    elif rows:
        chosen = "; ".join(f"{r} rows: " + ", ".join(f"{k} {n}" for k, n in c.items()) for r, c in rows.items())
    else:
        chosen = "none measured yet (each shape is timed at its first use, then kept)"
    return [
        "Machine",
        f"  CPU               {m['cpu']}{flags}, {m['threads']} torch threads",
        f"  BLAS              {m['blas']} (torch {m['torch']})",
        f"  decoding products {chosen}",
        f"  timed candidates  {', '.join(m.get('products_candidates', []))}",
        *(
            [f"  packed copies     up to {m['products_packed_budget_gib']:g} GiB (DFLASHKIT_PACKED_MAX_GB)"]
            if m.get("products_packed_budget_gib") is not None
            else []
        ),
        *([f"  native kernel     {_native(m['products_native'])}"] if "products_native" in m else []),
        f"  choices kept      {_kept(m)}",
        *_precision_lines(m, "train"),
        *_precision_lines(m, "capture"),
        *_compile_lines(m, "train"),
        *_compile_lines(m, "capture"),
        *_compile_lines(m, "regenerate"),
        *_compile_lines(m, "decode"),
    ]


def _compile_lines(m: dict[str, Any], name: str) -> list[str]:
    """Whether `name`'s steps run compiled under `auto`: forced, or each stored trial below the line."""
    forced, by_key = m.get(f"{name}_compile_forced"), m.get(f"{name}_compile_by_key") or {}
    unit, (title, what) = m.get(f"{name}_compile_unit", "a step"), _COMPILE_TEXT[name]
    if forced:
        head = f"{forced} under compile auto"
    elif by_key:
        head = f"compile auto, timed in {what} per key:"
    else:
        head = f"compile auto: timed in {what} (none stored yet)"

    def row(k: str, e: dict[str, Any]) -> str:
        if e.get("unusable"):
            return f"    {k}: eager (compiling failed: {e['unusable']})"
        return (
            f"    {k}: {e['choice']} (eager {e['eager_ms']:g} ms, compiled {e['compiled_ms']:g} ms {unit}, "
            f"{e['compile_s']:g} s to compile)"
        )

    return [f"  {title:<18}{head}", *[row(k, e) for k, e in ([] if forced else by_key.items())]]


# a compile choice's line title, and where its trial runs
_COMPILE_TEXT = {
    "train": ("train compile", "a long run's first steps"),
    "capture": ("capture compile", "a large capture's first batches"),
    "regenerate": ("regen compile", "a long regeneration's first batches"),
    "decode": ("decode compile", "a long evaluation's warm-up"),
}


# a measured precision's lines: (title, its `auto` setting, what a choice is kept per, what a timing is of)
_PRECISION_TEXT = {
    "train": ("training (CPU)", "dtype auto", "drafter geometry and step shape", "a step"),
    "capture": ("capture (CPU)", "precision auto", "target and sequence length", "a forward"),
}


def _precision_lines(m: dict[str, Any], name: str) -> list[str]:
    """What `name` computes in on this CPU under `auto`: forced, or timed per key (each listed below the line)."""
    title, auto, per, unit = _PRECISION_TEXT[name]
    forced, by_key = m.get(f"{name}_precision_forced"), m.get(f"{name}_precision_by_key") or {}
    if forced:
        head = f"{forced} for every run"
    elif by_key:
        head = f"{auto}, timed per {per}:"
    else:
        head = f"{auto}: fp32 or bf16, timed at a run's start (none stored yet)"
    rows = [] if forced else by_key.items()
    return [
        f"  {title:<18}{head}",
        *[f"    {k}: {e['choice']} (fp32 {e['fp32_ms']:g} ms, bf16 {e['bf16_ms']:g} ms {unit})" for k, e in rows],
    ]


def _native(status: dict[str, Any]) -> str:
    """The few-row kernel compiled for this CPU (native_rows.py): where it is, or why there is none."""
    if status["available"]:
        return f"built for this CPU: {status['library']}"
    return f"not available ({status['reason']}): native_rows is not timed"


def _kept(m: dict[str, Any]) -> str:
    """Where the measured choices are kept and when they are timed again (cpu_products/choice.py)."""
    if m.get("products_store") is None:
        return "in this process only (DFLASHKIT_CHOICES=store=off or no cache)"
    oldest = m.get("products_oldest_days")
    age = f"; the oldest {oldest:g} days old" if oldest is not None else ""
    return f"{m['products_store']} (timed again after {m['products_max_age_days']:g} days{age})"


__all__ = ["gather_info", "render_info"]
