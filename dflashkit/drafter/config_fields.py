"""Types of the fields of a z-lab drafter config.json, checked before any value is used.

`check_zlab_field_types(raw, source)` raises ConfigError naming the file, the field (`dflash_config.X` when it
sits there) and the expected type, e.g.

    ckpt/config.json: field 'num_hidden_layers' must be an integer, got "two" (a string)

so that a hand-edited config never surfaces as a bare `int()` failure or a traceback deep inside the model.
Integral floats (64.0) count as integers and integers as floats; `null` is accepted only where the format
allows it to be absent.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dflashkit.errors import ConfigError

INT, FLOAT, BOOL, STR, DICT, INT_LIST, STR_LIST = (
    "an integer",
    "a number",
    "true or false",
    "a string",
    "a JSON object",
    "a list of integers",
    "a list of strings",
)

# field → (expected kind, null allowed): the backbone's; each head declares its own (`HeadFormat.zlab_field_types`)
ZLAB_FIELDS: dict[str, tuple[str, bool]] = {
    "hidden_size": (INT, False),
    "vocab_size": (INT, False),
    "num_hidden_layers": (INT, False),
    "num_attention_heads": (INT, False),
    "num_key_value_heads": (INT, False),
    "head_dim": (INT, False),
    "intermediate_size": (INT, False),
    "block_size": (INT, False),
    "mask_token_id": (INT, False),
    "max_position_embeddings": (INT, False),
    "num_target_layers": (INT, True),
    "draft_vocab_size": (INT, True),
    "sliding_window": (INT, True),
    "rms_norm_eps": (FLOAT, False),
    "rope_theta": (FLOAT, False),
    "attention_bias": (BOOL, True),
    "is_causal": (BOOL, True),
    "use_sliding_window": (BOOL, True),
    "mask_embedding": (BOOL, True),
    "hidden_act": (STR, False),
    "target_layer_ids": (INT_LIST, True),
    "layer_types": (STR_LIST, True),
    "rope_parameters": (DICT, True),
    "dflashkit": (DICT, True),
}


def _is_int(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (
        isinstance(v, float) and math.isfinite(v) and v.is_integer()
    )


def _fits(kind: str, v: Any) -> bool:
    if kind == INT:
        return _is_int(v)
    if kind == FLOAT:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == BOOL:
        return isinstance(v, bool)
    if kind == STR:
        return isinstance(v, str)
    if kind == DICT:
        return isinstance(v, dict)
    if kind == INT_LIST:
        return isinstance(v, list) and all(_is_int(x) for x in v)
    return isinstance(v, list) and all(isinstance(x, str) for x in v)  # STR_LIST


def _describe(v: Any) -> str:
    if v is None:
        return "null"
    kind = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(v), type(v).__name__)
    text = json.dumps(v, default=str)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({kind})"


# each head's own config.json fields (`HeadFormat.zlab_field_types`), added by the head registry when it is imported
HEAD_FIELDS: dict[str, tuple[str, bool]] = {}


def add_head_fields(types: dict[str, tuple[str, bool]]) -> None:
    """Check a head's own config.json fields like the backbone's (the registry calls this for every head)."""
    HEAD_FIELDS.update(types)


def zlab_field_types() -> dict[str, tuple[str, bool]]:
    """The backbone's config.json fields and every registered head's own."""
    return {**ZLAB_FIELDS, **HEAD_FIELDS}


def field_value_ok(name: str, value: Any) -> bool:
    """Whether `value` has the type config.json field `name` needs (unknown fields: always)."""
    types = zlab_field_types()
    if name not in types:
        return True
    kind, nullable = types[name]
    return (value is None and nullable) or _fits(kind, value)


def field_type_problem(name: str, value: Any) -> str | None:
    """ "must be an integer, got "two" (a string)" when `value` does not fit field `name`, else None."""
    if field_value_ok(name, value):
        return None
    kind, nullable = zlab_field_types()[name]
    return f"must be {kind}{' (or null)' if nullable else ''}, got {_describe(value)}"


def check_zlab_field_types(raw: dict[str, Any], source: str = "config.json") -> None:
    """Raise ConfigError for the first known field of `raw` (or of its dflash_config) with the wrong type."""
    dflash = raw.get("dflash_config")
    if dflash is not None and not isinstance(dflash, dict):
        raise ConfigError(f"{source}: field 'dflash_config' must be {DICT}, got {_describe(dflash)}")
    places = [("dflash_config.", dflash or {}), ("", raw)]
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):
        places.append(("rope_parameters.", {k: rope[k] for k in ("rope_theta",) if k in rope}))
    for prefix, fields in places:
        for name, value in fields.items():
            problem = field_type_problem(name, value)
            if problem:
                raise ConfigError(f"{source}: field '{prefix}{name}' {problem}")
