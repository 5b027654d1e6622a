"""The interface every drafter head implements, with the DFlash backbone's own behaviour as its defaults.

A drafter = the DFlash backbone (context K/V from the fused target features, a block of [token, MASK…]) + a head +
an objective. Stages ask the head of a drafter's config (`dflashkit.drafter.heads.head_of`) instead of branching on
its kind:

    head.fields                     config fields only this kind reads (refused for other kinds by name)
    head.train_fields               training options only this kind's objective reads (likewise)
    head.architectures              the `architectures` entry of its z-lab config.json; `zlab_fields(cfg)` the rest
    head.extra_parameters(cfg)      parameters it adds to the backbone's
    head.first_draft_slot           block slot of the first draft (DFlash 1: slot 0 holds the given token)
    head.drafts_per_round(bs)       drafts one block proposes
    head.metric_slots(bs)           entries of the per-slot training metrics
    head.reads_final_layer          whether training reads the target's final-layer output (its distribution)
    head.reads_target_lse(cfg, t)   whether training reads the log-sum-exp of the target's logits
    head.training_needs_target      whether a training run keeps the target loaded (offline features included)
    head.train_checks(train_cfg)    training options this head cannot take, refused by name
    head.add_modules(drafter)       its parameters on the drafter (and `reset(drafter, std)` their init)

A new head subclasses `Head`, overrides what differs, and is added to the registry in `__init__.py`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class Head:
    """The DFlash head: the backbone's logits through the target's LM head, slot 0 holding the given token."""

    kind: ClassVar[str] = "dflash"
    label: ClassVar[str] = "DFlash"
    fields: ClassVar[tuple[str, ...]] = ()
    train_fields: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ("DFlashDraftModel",)
    first_draft_slot: ClassVar[int] = 1
    reads_final_layer: ClassVar[bool] = False
    training_needs_target: ClassVar[bool] = False

    def drafts_per_round(self, block_size: int) -> int:
        """Drafts one block proposes: the slots after the first draft slot."""
        return block_size - self.first_draft_slot

    def verify_width(self, block_size: int) -> int:
        """1 + the drafts a round proposes: the rows of a chain verification."""
        return 1 + self.drafts_per_round(block_size)

    def metric_slots(self, block_size: int) -> int:
        """Entries of the per-slot metric vectors of training (entry k: slot k's accuracy)."""
        return block_size + (1 - self.first_draft_slot)

    def extra_parameters(self, cfg: Any) -> int:
        """Parameters this head adds to the backbone's (from the config alone)."""
        return 0

    def zlab_fields(self, cfg: Any) -> dict[str, Any]:
        """Top-level config.json fields this head writes (as the engines that run it read them)."""
        return {}

    def reads_target_lse(self, cfg: Any, target: Any) -> bool:
        """Whether training reads the log-sum-exp of the target's logits per position (stored at capture)."""
        return False

    def train_checks(self, train_cfg: Any) -> None:
        """Raise ConfigError naming a training option this head cannot train with."""

    def add_modules(self, drafter: Any) -> None:
        """Add this head's parameters to `drafter` (the backbone is built already)."""

    def reset(self, drafter: Any, std: float) -> None:
        """Initialise this head's parameters (called by the drafter's `reset_parameters`)."""


__all__ = ["Head"]
