"""The XPress head (arXiv 2608.02438; speculators' `xpress` model): a low-rank causal refiner biases the backbone's
logits of every slot from its hidden state, the block's mean state and the token before it; K Jacobi passes decode
the block.

Its network (and the Jacobi passes) is in `xpress_net.py`, its drafting in `xpress_draft.py`, its objective in
`xpress_loss.py`; this module is what the stages ask about it.

Layout: speculators' (`speculators_model_type: xpress`, `architectures: ["XPressSpeculator"]`, top-level
`xpress_rank`, `xpress_mlp_ratio`, `num_jacobi_passes`, `sample_from_anchor: false` — slot 0 holds the anchor, as
DFlash — and the tensors `refiner_head.*`). dflashkit's own checkpoints use the z-lab layout with
`architectures: ["XPressDraftModel"]` and the three fields in `dflash_config`. speculators' other alignment
(`sample_from_anchor: true`, every slot drafting) is refused on import. vLLM's XPress model is an open pull request
(vllm-project/vllm#54448: its own `Qwen3XPressModel` layout, GPU model runner only, greedy only), so no released
engine serves an XPress drafter yet.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from dflashkit.drafter.config_fields import INT
from dflashkit.drafter.heads.base import BlockSlots, DraftRound, Head, HeadObjective, TrainingTerms
from dflashkit.drafter.heads.format import HeadFormat
from dflashkit.errors import ConfigError
from dflashkit.validation import NonNegativeFloat, NonNegativeInt, PositiveInt, UnitInterval

# speculators' defaults, which its converted checkpoints carry
SPECULATORS_DEFAULTS = {"xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6}


@dataclass(kw_only=True)
class XPressSettings:
    """drafter.kind: xpress — its fields of the drafter config (held as an XPress config's `head_settings`)."""

    xpress_rank: PositiveInt = 256  # the refiner's width r (token table, fusion, mixer, MLP)
    xpress_mlp_ratio: PositiveInt = 2  # the refiner's SwiGLU MLP width: r × this
    num_jacobi_passes: NonNegativeInt = 6  # refiner passes per round at decoding (0: the backbone's drafts)


@dataclass(kw_only=True)
class XPressTrainSettings:
    """drafter.kind: xpress — its training options (held in `TrainConfig.head_options["xpress"]`)."""

    # drafter.kind: xpress — weight of the mean loss of the free-running rounds (each reads the previous round's
    # argmax as its previous tokens, as Jacobi decoding does; no gradient between rounds)
    consistency_weight: NonNegativeFloat = 0.3
    consistency_passes: NonNegativeInt = 3  # drafter.kind: xpress — free-running rounds per step
    base_anchor_weight: NonNegativeFloat = 0.6  # drafter.kind: xpress — weight of the loss of the backbone's own logits
    # drafter.kind: xpress — with a distribution loss (tv, kl, …): each term is (1 − w)·that loss + w·CE
    # (speculators' {"ce": 0.1, "tv": 0.9}: loss: tv, labels: target)
    xpress_ce_weight: UnitInterval = 0.1


_FIELDS = tuple(f.name for f in dataclasses.fields(XPressSettings))
VLLM_PROBLEM = (
    "no vLLM release has an XPress drafter model (its pull request vllm-project/vllm#54448 is in review, GPU "
    "model runner only)"
)


class XPressFormat(HeadFormat):
    """XPress's layouts: speculators' XPressSpeculator and dflashkit's z-lab XPressDraftModel."""

    # ------------------------------------------------------------------ config.json layouts
    def fields_from_zlab(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        dflash = raw.get("dflash_config") or {}
        missing = [n for n in _FIELDS if dflash.get(n, raw.get(n)) is None]
        if missing:
            raise ConfigError(f"{source}: an XPress drafter needs dflash_config.{missing[0]} (an integer)")
        return {n: dflash.get(n, raw.get(n)) for n in _FIELDS}

    def zlab_dflash_fields(self, cfg: Any) -> dict[str, Any]:
        return cfg.head_fields()

    def speculators_fields(self, cfg: Any) -> dict[str, Any]:
        return cfg.head_fields()

    def fields_from_speculators(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """DrafterConfig fields of a speculators XPress config (its defaults where a field is absent)."""
        return {n: int(raw.get(n, d)) for n, d in SPECULATORS_DEFAULTS.items()}

    def gguf_problems(self, cfg: Any) -> list[str]:
        return ["llama.cpp has no XPress drafter (its dflash graph has no refiner)"]

    # ------------------------------------------------------------------ inspect
    def describe(self, facts: dict[str, Any], block_size: Any) -> str:
        d = facts.get("heads")
        if not d or not isinstance(block_size, int):
            return super().describe(facts, block_size)
        return f" (XPress: {block_size - 1} drafts a round; refiner rank {d['xpress_rank']}, {d['passes']} passes)"

    def inspect_facts(self, tensors: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
        down = tensors.get("refiner_head.down_h.weight")
        return {
            "xpress_rank": down["shape"][0] if down else (cfg.head_settings.xpress_rank if cfg else None),
            "passes": cfg.head_settings.num_jacobi_passes if cfg else None,
        }


class XPressHead(Head):
    """Slot 0 holds the given token (as DFlash); slots 1 … bs − 1 draft, refined by the causal refiner."""

    kind: ClassVar[str] = "xpress"
    settings: ClassVar[type | None] = XPressSettings
    train_settings: ClassVar[type | None] = XPressTrainSettings
    format: ClassVar[HeadFormat] = XPressFormat(
        title="XPress",
        zlab_field_types={
            "xpress_rank": (INT, False),
            "xpress_mlp_ratio": (INT, False),
            "num_jacobi_passes": (INT, False),
        },
        architectures=("XPressDraftModel",),
        speculators_architecture="XPressSpeculator",
        vllm_problem=VLLM_PROBLEM,
        vllm_cpu_problem=VLLM_PROBLEM,
        zlab_problem="z-lab's DFlashDraftModel has no XPress refiner",
        deepspec_problem=(
            "an XPress drafter: DeepSpec's Qwen3DSparkModel has no refiner — export it with --to speculators"
        ),
        # the quickstart's budget: a refiner sized to the small default target (its token table alone is V × r); the
        # quickstart's draft vocabulary keeps the loss at CE (speculators' CE + TV needs the whole vocabulary)
        quickstart_drafter={"xpress_rank": 64},
    )

    # ------------------------------------------------------------------ config
    def extra_parameters(self, cfg: Any) -> int:
        """Token table V·r, D_h and D_g 2·H·r, fusion 3r·r, mixer r·bs², MLP 3·r·(r·ratio), readout V'·r."""
        r, ratio, h = cfg.head_settings.xpress_rank, cfg.head_settings.xpress_mlp_ratio, cfg.hidden_size
        v, vd = cfg.vocab_size, cfg.draft_vocab_size or cfg.vocab_size
        return v * r + 2 * h * r + 3 * r * r + r * cfg.block_size**2 + 3 * r * r * ratio + vd * r

    def add_modules(self, drafter: Any) -> None:
        from dflashkit.drafter.heads.xpress_net import build_refiner

        build_refiner(drafter)

    def reset(self, drafter: Any, std: float) -> None:
        drafter.refiner_head.reset(std)

    # ------------------------------------------------------------------ training
    def train_checks(self, train_cfg: Any, drafter_cfg: Any) -> None:
        if train_cfg.loss == "topk":
            raise ConfigError(
                "loss: 'topk' cannot train an XPress drafter (drafter.kind: xpress): its terms are CE or a loss "
                "against the target's whole distribution (tv, kl, …)"
            )
        if train_cfg.fsdp:
            raise ConfigError(
                "fsdp: True cannot train an XPress drafter (drafter.kind: xpress): its refiner runs outside the "
                "sharded forward"
            )
        options, defaults = self.train_options(train_cfg), XPressTrainSettings()
        if train_cfg.loss == "ce" and options.xpress_ce_weight != defaults.xpress_ce_weight:
            raise ConfigError(
                f"xpress_ce_weight: {options.xpress_ce_weight} has no effect with loss: ce (every term is CE "
                f"already); leave it unset, or train a distribution loss (loss: tv)"
            )
        if options.consistency_weight == 0 and options.consistency_passes != defaults.consistency_passes:
            raise ConfigError(
                f"consistency_passes: {options.consistency_passes} has no effect with consistency_weight: 0 (no "
                f"free-running round is trained); leave it unset"
            )

    def objective(self, terms: TrainingTerms) -> HeadObjective | None:
        """Teacher-forced, free-running and backbone terms (xpress_loss.py), replacing the backbone's objective."""
        from dflashkit.drafter.heads.xpress_loss import xpress_objective

        return xpress_objective(terms, self.train_options(terms.train_cfg))

    # ------------------------------------------------------------------ decoding
    def draft_round(self, r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        from dflashkit.drafter.heads.xpress_draft import draft_xpress

        return draft_xpress(r)

    def tree_conditional(
        self, drafter: Any, draft_logits: Tensor, hidden: Tensor, embed_weight: Tensor, block: BlockSlots | None = None
    ) -> Any:
        """The last Jacobi pass's per-depth marginals (`draft_round` returns them as its logits already)."""
        from dflashkit.drafter.heads.xpress_draft import marginal_conditional

        return marginal_conditional(drafter, draft_logits, block)

    def greedy_drafts(
        self, drafter: Any, draft_logits: Tensor, first_prev: int, hidden: Tensor, embed_weight: Tensor,
        block: BlockSlots | None = None,
    ) -> tuple[list[int], Tensor]:  # fmt: skip
        from dflashkit.drafter.heads.xpress_draft import greedy_chain

        return greedy_chain(drafter, draft_logits, first_prev, block)

    def teacher_forced_logits(
        self, drafter: Any, draft_logits: Tensor, prev_tokens: Tensor, hidden: Tensor, embed_weight: Tensor,
        block: BlockSlots | None = None,
    ) -> Tensor:  # fmt: skip
        from dflashkit.drafter.heads.xpress_draft import teacher_forced

        return teacher_forced(drafter, draft_logits, prev_tokens, block)


__all__ = ["XPressFormat", "XPressHead", "XPressSettings", "XPressTrainSettings"]
