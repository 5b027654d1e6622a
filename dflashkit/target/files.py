"""A target's files, checked before transformers loads them: `config.json` (valid JSON, sizes that are positive
integers and fit this machine's memory) and `.gguf` files (a header the `gguf` reader can parse).

    check_model_dir(Path("models/Qwen3-8B"), bytes_per_parameter=2)   # → TargetError naming the file and field
    check_gguf(Path("model.Q4_1.gguf"))

Without these, a hand-edited `"hidden_size": 10000000` surfaces as `DefaultCPUAllocator: can't allocate memory`
deep inside a model constructor, and an empty `.gguf` as a struct error inside the reader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashkit.errors import TargetError
from dflashkit.validation import PositiveInt, memory_available, problem, show

# The sizes a decoder config must have (inside `text_config` for VL wrappers), and some it may have.
REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
OPTIONAL = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")


def _text_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    inner = raw.get("text_config")
    return (inner, "text_config.") if isinstance(inner, dict) else (raw, "")


def parameter_estimate(cfg: dict[str, Any]) -> int:
    """Rough parameter count of a decoder-only config (embeddings, attention, MLP; experts when it has them)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    inter = cfg.get("intermediate_size") or 4 * h
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 1
    inter = cfg.get("moe_intermediate_size") or inter if experts > 1 else inter
    attention = h * heads * hd * 2 + 2 * h * kv * hd
    mlp = 3 * h * inter * (experts if isinstance(experts, int) and experts > 0 else 1)
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp)


def check_model_dir(path: Path, *, bytes_per_parameter: int) -> None:
    """config.json of a model directory: readable JSON, the decoder sizes positive integers, and weights that fit
    the memory this machine can allocate (at `bytes_per_parameter`)."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise TargetError(f"{file}: not valid UTF-8 (byte offset {e.start}); expected a JSON model config") from None
    except json.JSONDecodeError as e:
        raise TargetError(f"{file}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(raw, dict):
        raise TargetError(f"{file}: expected a JSON object (a model config), got {type(raw).__name__}")
    cfg, prefix = _text_config(raw)
    for name in REQUIRED + OPTIONAL:
        if name not in cfg or (name in OPTIONAL and cfg[name] is None):
            if name in REQUIRED:
                raise TargetError(f"{file}: field '{prefix}{name}' is missing; expected a decoder model config")
            continue
        why = problem(PositiveInt, cfg[name])
        if why:
            raise TargetError(f"{file}: {prefix}{name} = {show(cfg[name])}: {why}")
    need = parameter_estimate(cfg) * bytes_per_parameter
    available = memory_available()
    if need > available:
        raise TargetError(
            f"{file}: this model (hidden_size {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, vocab_size "
            f"{cfg['vocab_size']}) needs about {need / 1e9:,.1f} GB for its weights; this machine can allocate "
            f"{available / 1e9:,.1f} GB"
        )


def check_gguf(path: Path) -> None:
    """A `.gguf` file the `gguf` reader can parse (magic, version, metadata, tensor table)."""
    if path.stat().st_size == 0:
        raise TargetError(f"{path}: empty file; expected a GGUF model")
    try:
        from gguf import GGUFReader

        GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct / numpy errors for damaged headers
        why = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise TargetError(f"{path}: not a readable GGUF file ({why}); expected an intact .gguf model") from None


__all__ = ["check_gguf", "check_model_dir", "parameter_estimate"]
