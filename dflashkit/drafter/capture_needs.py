"""What a capture must store for training a drafter: the target layers it reads, and whether the log-sum-exp of the
target's logits per position (`dflashkit capture --drafter-config`, the quickstart, `dflashkit train` online).

    capture_layer_ids(cfg)    # its own target_layer_ids (+ the final layer for DSpark: its loss reads the target's
                              #   distribution from that layer's output)
    capture_target_lse(cfg)   # DSpark with a reduced draft vocabulary: its loss forms only the draft ids' logits
"""

from __future__ import annotations

from dflashkit.drafter.config import DrafterConfig


def capture_layer_ids(cfg: DrafterConfig) -> list[int]:
    """The target layers a training run of this drafter reads: its own, and for DSpark also the final layer (its
    loss needs the target's distribution, computed from that layer's output)."""
    ids = list(cfg.target_layer_ids)
    if cfg.kind == "dspark" and cfg.num_target_layers - 1 not in ids:
        ids.append(cfg.num_target_layers - 1)
    return ids


def capture_target_lse(cfg: DrafterConfig) -> bool:
    """Whether training this drafter reads the log-sum-exp of the target's logits (DSpark with a draft vocabulary)."""
    return cfg.kind == "dspark" and bool(cfg.draft_vocab_size)


__all__ = ["capture_layer_ids", "capture_target_lse"]
