"""What a capture must store for training a drafter: the target layers it reads, and whether the log-sum-exp of the
target's logits per position (`dflashkit capture --drafter-config`, the quickstart, `dflashkit train` online).

    capture_layer_ids(cfg)    # its own target_layer_ids (+ the final layer for DSpark: its loss reads the target's
                              #   distribution from that layer's output)
    capture_target_lse(cfg, target)   # DSpark with a reduced draft vocabulary on a target with a plain LM head: its
                                      #   loss forms only the draft ids' logits and reads the log-sum-exp
"""

from __future__ import annotations

from typing import Any

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of


def capture_layer_ids(cfg: DrafterConfig) -> list[int]:
    """The target layers a training run of this drafter reads: its own, and for DSpark also the final layer (its
    loss needs the target's distribution, computed from that layer's output)."""
    ids = list(cfg.target_layer_ids)
    if head_of(cfg).reads_final_layer and cfg.num_target_layers - 1 not in ids:
        ids.append(cfg.num_target_layers - 1)
    return ids


def capture_target_lse(cfg: DrafterConfig, target: Any) -> bool:
    """Whether training this drafter reads the log-sum-exp of the target's logits: DSpark with a draft vocabulary,
    on a target whose logits are final_norm(h) · Wᵀ (`Target.plain_head`: a subset of them is a subset of W's rows)."""
    return head_of(cfg).reads_target_lse(cfg.draft_vocab_size, target)


__all__ = ["capture_layer_ids", "capture_target_lse"]
