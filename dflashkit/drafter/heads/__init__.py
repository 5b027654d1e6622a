"""Drafter heads on the one DFlash backbone, and the registry every stage asks about a drafter's kind.

    head = head_of(cfg)        # cfg.kind (or a kind name) → its Head: what the stages need to know of it
    head.format                # what the kind is to formats and engines: one frozen HeadFormat record
    KINDS                      # the kinds a drafter config may name
    DRAFTER_SETTINGS, TRAIN_SETTINGS   # the classes of the heads' own config fields and training options, held
                                       # nested: `DrafterConfig.head_settings`, `TrainConfig.head_options`

  base.py     `Head`: the interface, with the DFlash backbone's own behaviour as its defaults (the DFlash head)
  format.py   `HeadFormat`: what a kind is to formats and engines, DFlash's facts as its defaults
  dspark.py   `DSparkHead`: every slot drafts; a Markov head and a confidence head (DeepSpec's DSpark)
  dspark_net.py    its network: `MarkovHead`, `ConfidenceHead`, `markov_chain` (the greedy chain over a block)
  dspark_draft.py  its decoding round (the Markov head left to right) and its DDTree children's distribution
  dflash2.py  `DFlash2Head`: z-lab's DFlash2 — convolutions around every sublayer and a candidate selector
  dflash2_net.py, dflash2_draft.py, dflash2_loss.py  its network, its drafting (walk, lattice), its selector term
  domino.py   `DominoHead`: every slot drafts; a GRU over the block's previous tokens corrects the later slots
  domino_net.py, domino_draft.py, domino_loss.py  its network, its drafting (rollout, DDTree path states), its objective
  xpress.py   `XPressHead`: a low-rank causal refiner biases the backbone's logits; Jacobi passes decode the block
  xpress_net.py, xpress_draft.py, xpress_loss.py  its network (and the Jacobi passes), its drafting, its objective

A new head: a module here with a `Head` subclass (its `format` a `HeadFormat`), and one entry in HEADS.
"""

from __future__ import annotations

from typing import Any

from dflashkit.drafter.config_fields import add_head_fields
from dflashkit.drafter.heads.base import BlockSlots, DraftRound, Head, HeadObjective, TrainingTerms
from dflashkit.drafter.heads.dflash2 import DFlash2Head
from dflashkit.drafter.heads.domino import DominoHead
from dflashkit.drafter.heads.dspark import DSparkHead
from dflashkit.drafter.heads.format import HeadFormat
from dflashkit.drafter.heads.xpress import XPressHead

HEADS: dict[str, Head] = {head.kind: head for head in (Head(), DSparkHead(), DFlash2Head(), DominoHead(), XPressHead())}
KINDS = tuple(HEADS)
for _head in HEADS.values():  # a hand-edited config.json's head fields are type-checked like the backbone's
    add_head_fields(_head.format.zlab_field_types)


def head_of(config_or_kind: Any) -> Head:
    """The head of a drafter config (or of a kind name); configs without a kind are DFlash's."""
    kind = config_or_kind if isinstance(config_or_kind, str) else getattr(config_or_kind, "kind", "dflash")
    return HEADS[kind]


def kind_of_config(raw: dict[str, Any]) -> str:
    """The kind a config.json (z-lab layout) describes: the first head besides DFlash's that recognises it."""
    return next((h.kind for h in HEADS.values() if h.kind != "dflash" and h.format.recognises(raw)), "dflash")


# each head's drafter config fields and training options, as dataclasses the configs hold nested: a drafter config
# holds its kind's settings (`DrafterConfig.head_settings`), a training config every head's options
# (`TrainConfig.head_options`: which head trains is known only once the drafter is)
DRAFTER_SETTINGS: tuple[type, ...] = tuple(h.settings for h in HEADS.values() if h.settings is not None)
TRAIN_SETTINGS: tuple[type, ...] = tuple(h.train_settings for h in HEADS.values() if h.train_settings is not None)
# Where a layout lists every head's keys flat (the doors' field types, `DrafterConfig.to_dict`, a checkpoint's
# train_config.yaml), the registry's last head comes first: the order saved training configs hold them in, which a
# resumed run's file and the identities hashed from these layouts keep.
FLAT_DRAFTER_SETTINGS: tuple[type, ...] = DRAFTER_SETTINGS[::-1]
FLAT_TRAIN_SETTINGS: tuple[type, ...] = TRAIN_SETTINGS[::-1]


def kind_fields() -> dict[str, str]:
    """Config field → the kind whose head reads it (a field given for another kind is refused by name)."""
    return {name: head.kind for head in HEADS.values() for name in head.fields}


def train_kind_fields() -> dict[str, str]:
    """Training option → the kind whose objective reads it."""
    return {name: head.kind for head in HEADS.values() for name in head.train_fields}


__all__ = [
    "DRAFTER_SETTINGS",
    "FLAT_DRAFTER_SETTINGS",
    "FLAT_TRAIN_SETTINGS",
    "HEADS",
    "KINDS",
    "TRAIN_SETTINGS",
    "BlockSlots",
    "DraftRound",
    "Head",
    "HeadFormat",
    "HeadObjective",
    "TrainingTerms",
    "head_of",
    "kind_fields",
    "kind_of_config",
    "train_kind_fields",
]
