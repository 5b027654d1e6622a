"""The target's KV cache during verification: length, crop, compaction to an accepted tree path, and
snapshot/restore of the recurrent states of hybrid (linear-attention) layers.

transformers' `DynamicCache.crop` rewinds attention K/V but **not** GatedDeltaNet recurrent/conv states
(Qwen3.5/3.6, Qwen3-Next): after a rejected draft those states would silently keep the rejected tokens.
`snapshot` clones them before verification and `restore` puts them back, so the caller can re-run only the
accepted tokens. Attention layers are edited through their `keys`/`values` tensors (B, kv_heads, T, hd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflashkit.target.kv_buffer import in_place_compact


def _kv_layers(cache: Any) -> list[Any]:
    return [layer for layer in getattr(cache, "layers", []) if isinstance(getattr(layer, "keys", None), Tensor)]


def _linear_layers(cache: Any) -> list[Any]:
    return [layer for layer in getattr(cache, "layers", []) if hasattr(layer, "recurrent_states")]


def kv_length(cache: Any) -> int:
    """Tokens held by the attention layers of the cache (0 for an empty cache)."""
    lengths = {int(layer.keys.shape[-2]) for layer in _kv_layers(cache)}
    if len(lengths) > 1:
        raise RuntimeError(f"attention layers of the target cache disagree on length: {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def crop(cache: Any, length: int) -> None:
    """Keep the first `length` tokens of every attention layer."""
    for layer in _kv_layers(cache):
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


def keep_positions(cache: Any, base: int, rows: Tensor) -> None:
    """Compact after tree verification: keep tokens [0, base) plus tree nodes `rows` (indices into the tree)."""
    idx = torch.cat([torch.arange(base), base + rows.cpu()])  # (base + len(rows),)
    for layer in _kv_layers(cache):
        if in_place_compact(layer, base, rows.cpu()):
            continue  # moved inside its own buffers (kv_buffer.py)
        i = idx.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, i)
        layer.values = layer.values.index_select(-2, i)


_STATE_ATTRS = (
    "conv_states",
    "recurrent_states",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
)


@dataclass
class StateSnapshot:
    """Cloned conv/recurrent state dicts (and flags) of every linear-attention layer, plus the attention length."""

    kv_len: int
    states: list[dict[str, dict[int, Any]]]


def has_recurrent_state(cache: Any) -> bool:
    return bool(_linear_layers(cache))


def _clone(d: dict[int, Any]) -> dict[int, Any]:
    return {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in d.items()}


def snapshot(cache: Any) -> StateSnapshot:
    states = [
        {a: _clone(getattr(layer, a)) for a in _STATE_ATTRS if hasattr(layer, a)} for layer in _linear_layers(cache)
    ]
    return StateSnapshot(kv_len=kv_length(cache), states=states)


def restore(cache: Any, snap: StateSnapshot) -> None:
    """Put the recurrent states back and crop attention layers to the snapshot's length."""
    for layer, saved in zip(_linear_layers(cache), snap.states, strict=True):
        for attr, value in saved.items():
            setattr(layer, attr, _clone(value))
    crop(cache, snap.kv_len)
