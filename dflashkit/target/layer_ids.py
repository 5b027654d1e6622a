"""Which decoder layers of a target a list of `target_layer_ids` may name: 0-based, in range, each once.

Shared by the target (checked before a forward captures those layers) and the drafter config (checked when a
config names them), so both say the same thing in the same words.
"""

from __future__ import annotations


def layer_ids_problem(layer_ids: list[int], num_target_layers: int) -> str | None:
    """Why `layer_ids` cannot name decoder layers of a `num_target_layers`-layer target, or None if they can."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        return "target_layer_ids is empty; expected at least one target layer index"
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        return (
            f"target_layer_ids {bad} out of range: the target has {num_target_layers} decoder layers "
            f"(expected 0 ≤ id < {num_target_layers})"
        )
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        return f"target_layer_ids has duplicates {dup}; each target layer may be read once"
    return None
