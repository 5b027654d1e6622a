"""The interface every drafter head implements, with the DFlash backbone's own behaviour as its defaults.

A drafter = the DFlash backbone (context K/V from the fused target features, a block of [token, MASK…]) + a head +
an objective. Stages ask the head of a drafter's config (`dflashkit.drafter.heads.head_of`) instead of branching on
its kind:

    head.settings                   its drafter config fields: a keyword-only dataclass with their types (each type is
                                    its check) and defaults; a drafter config of its kind holds one nested
                                    (`cfg.head_settings.markov_rank`), the doors take them as flat keys; `head.fields`
                                    their names (refused for other kinds by name)
    head.train_settings             likewise the training options only its objective reads; a training config holds one
                                    per head (`head.train_options(train_cfg)`: this head's); `head.train_fields` their
                                    names
    head.format                     what the kind *is* to formats and engines — architectures, config.json and GGUF
                                    fields, engine verdicts, inspect's words, the quickstart's preset: one frozen
                                    `HeadFormat` record (heads/format.py), read by export, inspect, serve-check and
                                    the quickstart, never by training or decoding
    head.extra_parameters(cfg)      parameters it adds to the backbone's
    head.check_config(cfg, where)   rules between its config fields and the backbone's, refused by field
    head.add_modules(drafter)       its parameters on the drafter (and `reset(drafter, std)` their init)
    head.scale_embeddings(cfg, e)   the block's embeddings as its layers read them (default: unchanged)
    head.unary_logits(cfg, z)       the LM head's logits as its drafts read them; `unary_weight(cfg, w)` the same
                                    scaling on the LM-head rows (training forms h·Wᵀ in chunks)
    head.first_draft_slot           block slot of the first draft (DFlash 1: slot 0 holds the given token)
    head.drafts_per_round(bs)       drafts one block proposes (`verify_width(bs)`: 1 + those)
    head.metric_slots(bs)           entries of the per-slot training metrics
    head.reads_final_layer          whether training reads the target's final-layer output (its distribution)
    head.reads_target_lse(v, t)     whether training reads the log-sum-exp of the target's logits
    head.training_needs_target      whether a training run keeps the target loaded (offline features included)
    head.train_checks(t, d)         training options (and drafter fields) this head cannot train with, by name
    head.training_loss(t)           its own training term added to the objective (`TrainingTerms`; None: none)
    head.objective(t)               its whole objective in place of the backbone's (`HeadObjective`; None: none)
    head.draft_round(r)             one decoding round's drafts, their distribution q (T > 0), logits and hidden states
    head.confidence_gate            whether decoding may cut a round by a confidence head (`confidence_min`)
    head.tree_conditional(d, z, h, e, block)   how a DDTree node ranks its children (None: the per-depth marginals)
    head.greedy_drafts(d, z, prev, h, e, block)   greedy drafts from a block's logits (and the scores they were picked
                                    from)
    head.teacher_forced_logits(d, z, prevs, h, e, block)   slot scores given the true previous tokens (doctor)
                                    (z: the draft slots' logits, h: their hidden states, e: the target's embeddings,
                                    block: `BlockSlots`, the whole block's states and the token before it)

A new head subclasses `Head`, overrides what differs, gives its `HeadFormat` (a subclass where its layouts need
functions of their own), and is added to the registry in `__init__.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dflashkit.drafter.heads.format import HeadFormat
from dflashkit.sampling import SamplingParams, probs, sample


@dataclass
class DraftRound:
    """What one decoding round's drafting reads: the models, the drafter's cache and the new context (the features
    of the tokens committed last round at their positions), the bonus token at `start`, the block size, how many
    drafts can still be committed, and how drafts are chosen."""

    target: Any
    drafter: Any
    cache: Any  # DrafterCache: context K/V only
    bonus: int
    new_ctx: Tensor | None  # (1, n, K·H)
    new_pos: Tensor | None  # (1, n)
    start: int
    block_size: int
    n_verify: int
    sampling: SamplingParams
    draft_sampling: bool
    generator: torch.Generator | None
    confidence_min: float | None = None
    before: int | None = None  # the token before the bonus (a head reading the whole block's previous tokens)


@dataclass
class BlockSlots:
    """What a head reading the whole block needs beyond its draft slots: every slot's hidden state, slot 0 first, the
    block's first token and the token before it (target ids)."""

    hidden: Tensor  # (bs, H)
    first: int
    before: int


@dataclass
class TrainingTerms:
    """What a head's own training term reads of one step: the drafter, its final-normed block states, the LM-head rows
    of the draft vocabulary, each slot's label (draft ids) and the data token before it (target ids), the slot
    weights, the step's normaliser, the step (0-based) and the training config."""

    drafter: Any
    hidden: Tensor  # (N, bs, H)
    head_weight: Tensor  # (V', H), frozen
    labels: Tensor  # (N, bs) long draft ids, −100 invalid
    prev_tokens: Tensor  # (N, bs) long target ids: the token at a + k − 1 for slot k
    weights: Tensor  # (bs,)
    normalizer: Tensor | float
    step: int
    train_cfg: Any
    weights_of: Any  # (per-slot loss (N, bs), counted (N, bs) bool) → slot weights (N, bs): the objective's own rule
    embed_weight: Tensor | None = None  # (V, H) the target's embedding table, frozen
    total_steps: int = 1  # the run's planned optimiser steps (a step-based schedule's horizon)
    progress: float | None = None  # a time-based run: the fraction of its schedule spent (None: step / total_steps)
    # (hidden (N, bs, H + r), rows (V', H), kind=None, extra=None) → LossOutput: the run's configured objective
    # (`kind`: another loss kind) over the step's labels, slot weights and normaliser, for the logits
    # hidden·[rows ; extra]ᵀ — `extra` (V', r) trainable rows beside the frozen ones (r = 0 without it)
    backbone_loss: Any = None
    target_labels: Tensor | None = None  # (N, bs) long the labels as target ids (−100 invalid; `labels` are draft ids)
    # where the head reads the target's final layer (`reads_final_layer`): flattened slot ids (m,) → the target's
    # logits at each slot's index (m, V), or (logits of U distinct positions, each slot's index into them), or (their
    # draft-id logits (U, V'), log-sum-exp over V (U,), index (m,)) — see dspark_loss.py `_target_probs`
    target_logits: Any = None


@dataclass
class HeadObjective:
    """A head's whole objective of one step, in place of the backbone's: the loss (a scalar, already normalised) and,
    per block slot (bs,), how many live slots its drafts got right and how many there were (and, where its weights
    are its own, their sum over the valid slots)."""

    loss: Tensor
    correct_counts: Tensor  # (bs,) long
    valid_counts: Tensor  # (bs,) long
    weight_sum: Tensor | None = None  # Σ slot weights over the valid slots (None: the run's weights · valid_counts)


class Head:
    """The DFlash head: the backbone's logits through the target's LM head, slot 0 holding the given token."""

    kind: ClassVar[str] = "dflash"
    # @dataclass(kw_only=True): its drafter config fields, held as `DrafterConfig.head_settings` (None: it has none)
    settings: ClassVar[type | None] = None
    # @dataclass(kw_only=True): its training options, held in `TrainConfig.head_options` (None: it has none)
    train_settings: ClassVar[type | None] = None
    fields: ClassVar[tuple[str, ...]] = ()  # names of `settings`' fields
    train_fields: ClassVar[tuple[str, ...]] = ()  # names of `train_settings`' fields
    first_draft_slot: ClassVar[int] = 1
    reads_final_layer: ClassVar[bool] = False
    training_needs_target: ClassVar[bool] = False
    confidence_gate: ClassVar[bool] = False
    format: ClassVar[HeadFormat] = HeadFormat()  # what the kind is to formats and engines (heads/format.py)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.fields = _names(cls.settings)
        cls.train_fields = _names(cls.train_settings)

    def train_options(self, train_cfg: Any) -> Any:
        """Its training options in a training config: the instance of `train_settings` it holds for this kind."""
        return train_cfg.head_options[self.kind]

    def scale_embeddings(self, cfg: Any, embeds: Tensor) -> Tensor:
        """The block's embeddings (…, H) as the backbone's layers read them."""
        return embeds

    def unary_logits(self, cfg: Any, logits: Tensor) -> Tensor:
        """The LM head's logits (…, V') as this head's drafts and DDTree read them."""
        return logits

    def unary_weight(self, cfg: Any, weight: Tensor) -> Tensor:
        """The LM-head rows (V', H) whose products with the hidden states are the logits training supervises."""
        return weight

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

    def reads_target_lse(self, draft_vocab_size: int | None, target: Any) -> bool:
        """Whether training reads the log-sum-exp of the target's logits per position (stored at capture)."""
        return False

    def train_checks(self, train_cfg: Any, drafter_cfg: Any) -> None:
        """Raise ConfigError naming a training option (or drafter field) this head cannot train with."""

    def check_config(self, cfg: Any, where: Any) -> None:
        """Raise ConfigError naming a field of `cfg` that breaks a rule of this head (`where(field)`: its source)."""

    def training_loss(self, terms: TrainingTerms) -> Tensor | None:
        """This head's own term of the training loss (a scalar, already normalised), or None."""
        return None

    def objective(self, terms: TrainingTerms) -> HeadObjective | None:
        """This head's whole objective in place of the backbone's (None: the backbone's objective + `training_loss`)."""
        return None

    def add_modules(self, drafter: Any) -> None:
        """Add this head's parameters to `drafter` (the backbone is built already)."""

    def reset(self, drafter: Any, std: float) -> None:
        """Initialise this head's parameters (called by the drafter's `reset_parameters`)."""

    def draft_round(self, r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """One drafter pass over [bonus, MASK × (bs − 1)]: (drafts (nv,) as target ids, draft distribution q over the
        target vocabulary when drafts are sampled (else None), draft logits (nv, V'), the draft slots' hidden states
        (nv, H))."""
        drafter, target = r.drafter, r.target
        embeds = drafter.block_embeddings(torch.tensor([[r.bonus]]), target.embed_weight, r.block_size)
        positions = torch.arange(r.start, r.start + r.block_size)[None]
        hidden = drafter(r.new_ctx, embeds, context_positions=r.new_pos, block_positions=positions, cache=r.cache)
        hidden = hidden[0, 1 : r.n_verify + 1]  # (nv, H)
        draft_logits = drafter.logits(hidden, target.lm_head_weight).float()  # (nv, V')
        if r.sampling.greedy or not r.draft_sampling:
            return drafter.to_target_ids(draft_logits.argmax(-1)), None, draft_logits, hidden
        draft_q = probs(draft_logits, r.sampling)
        drafts = drafter.to_target_ids(sample(draft_q, r.generator))
        return drafts, q_over_target(drafter, draft_q, target.vocab_size), draft_logits, hidden

    def tree_conditional(
        self, drafter: Any, draft_logits: Tensor, hidden: Tensor, embed_weight: Tensor, block: BlockSlots | None = None
    ) -> Any:
        """A node's children ranked by a distribution given its path (None: DDTree's per-depth marginals of
        `draft_logits`); draft_logits (n, V') and hidden (n, H) are the block's draft slots as `draft_round` returns
        them, embed_weight (V, H) the target's table; `block` the whole block, where the caller ran the backbone
        itself (draft_logits are then the backbone's)."""
        return None

    def greedy_drafts(
        self, drafter: Any, draft_logits: Tensor, first_prev: int, hidden: Tensor, embed_weight: Tensor,
        block: BlockSlots | None = None,
    ) -> tuple[list[int], Tensor]:  # fmt: skip
        """(greedy drafts as target ids, the scores (n, V') they are the argmax of) from a block's backbone logits
        (`block`: the whole block, for a head that reads it)."""
        return drafter.to_target_ids(draft_logits.argmax(-1)).tolist(), draft_logits

    def teacher_forced_logits(
        self, drafter: Any, draft_logits: Tensor, prev_tokens: Tensor, hidden: Tensor, embed_weight: Tensor,
        block: BlockSlots | None = None,
    ) -> Tensor:  # fmt: skip
        """Slot scores (n, V') when slot j's previous token is `prev_tokens[j]` (a transcript's own)."""
        return draft_logits


def q_over_target(drafter: Any, q: Tensor, vocab_size: int) -> Tensor:
    """A draft distribution over draft ids (n, V') as the p/q rule reads it, over target ids (n, V): zero outside a
    reduced draft vocabulary (unchanged without one)."""
    if drafter.config.draft_vocab_size is None:
        return q
    full = torch.zeros(q.shape[0], vocab_size, device=q.device)
    return full.index_copy_(1, drafter.draft_to_target.to(q.device), q)


def _names(settings: type | None) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(settings)) if settings is not None else ()


__all__ = ["BlockSlots", "DraftRound", "Head", "HeadObjective", "TrainingTerms", "q_over_target"]
