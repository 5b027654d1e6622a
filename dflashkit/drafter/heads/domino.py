"""The Domino head (arXiv 2605.29707; Model-Optimizer's and SpecForge's trainers): every slot drafts, and a GRU over
the block's previous tokens with a small projection corrects the backbone's logits of the later slots.

Its network is in `domino_net.py`, its drafting (the left-to-right rollout, the DDTree path states) in
`domino_draft.py`, its objective in `domino_loss.py`; this module is what the stages ask about it.

Layout (Model-Optimizer's `DominoExporter`, SpecForge's `DominoDraftModel`): a z-lab DFlash checkpoint
(`architectures: ["DFlashDraftModel"]`) whose `dflash_config` adds `projector_type: "domino"`, `shift_label: true`
(slot k drafts the token at a + k + 1), `pure_draft_prefix_len`, `gru_hidden_dim` and `emb_dim` (also at the top
level), with the tensors `prefix_gru.weight_ih_l0`, `prefix_gru.weight_hh_l0`, `embed_proj.0.weight` and
`embed_proj.2.weight`. SpecForge also trains `shift_label: false` (slot 0 holds the anchor, as DFlash): another
alignment of the same network, which dflashkit refuses by name on import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from dflashkit.drafter.config_fields import BOOL, INT, STR
from dflashkit.drafter.heads.base import DraftRound, Head, HeadObjective, TrainingTerms
from dflashkit.drafter.heads.format import HeadFormat
from dflashkit.errors import ConfigError
from dflashkit.validation import NonNegativeInt, PositiveInt, UnitInterval, fail


@dataclass(kw_only=True)
class DominoSettings:
    """drafter.kind: domino — its fields of the drafter config (held as a Domino config's `head_settings`)."""

    gru_hidden_dim: PositiveInt = 256  # width of the GRU over the block's previous tokens
    emb_dim: PositiveInt = 256  # width of the projection [hidden ; GRU state] → logit correction
    pure_draft_prefix_len: NonNegativeInt = 1  # the first drafts of a block left uncorrected (the references' 1)


@dataclass(kw_only=True)
class DominoTrainSettings:
    """drafter.kind: domino — its training options (held in `TrainConfig.head_options["domino"]`)."""

    # drafter.kind: domino — loss = (1 − λ)·CE(corrected) + λ·CE(backbone); λ starts at lambda_base_start and falls
    # linearly to 0 over lambda_base_decay_ratio of the run (SpecForge's 0.5; Model-Optimizer's default is 1.0)
    lambda_base_start: UnitInterval = 1.0
    lambda_base_decay_ratio: UnitInterval = 0.5  # drafter.kind: domino — fraction of the run over which λ falls to 0


VLLM_PROBLEM = "vLLM has no Domino drafter model (SGLang serves Domino: --to zlab)"


class DominoFormat(HeadFormat):
    """Domino's layout: Model-Optimizer's and SpecForge's z-lab DFlash checkpoint with `projector_type: "domino"`."""

    # ------------------------------------------------------------------ config.json layouts
    def recognises(self, raw: dict[str, Any]) -> bool:
        return (raw.get("dflash_config") or {}).get("projector_type") == "domino"

    def fields_from_zlab(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        dflash = raw.get("dflash_config") or {}
        for name, why in (
            ("shift_label", "Model-Optimizer writes true, SpecForge's default is false"),
            ("pure_draft_prefix_len", "Model-Optimizer's default is 1, SpecForge's 0"),
        ):
            if dflash.get(name) is None:
                raise ConfigError(
                    f"{source}: a Domino drafter needs dflash_config.{name} ({why}: a checkpoint without it is "
                    f"ambiguous); add the value it was trained with"
                )
        if dflash["shift_label"] is not True:
            raise ConfigError(
                f"{source}: dflash_config.shift_label false (slot 0 holds the anchor, SpecForge's other alignment) "
                f"is not supported; dflashkit's Domino drafts from every slot (shift_label: true, Model-Optimizer's "
                f"layout)"
            )
        missing = [n for n in ("gru_hidden_dim", "emb_dim") if dflash.get(n, raw.get(n)) is None]
        if missing:
            raise ConfigError(f"{source}: a Domino drafter needs dflash_config.{missing[0]} (an integer ≥ 1)")
        out = {n: dflash.get(n, raw.get(n)) for n in ("gru_hidden_dim", "emb_dim")}
        out["pure_draft_prefix_len"] = dflash["pure_draft_prefix_len"]
        return out

    def zlab_dflash_fields(self, cfg: Any) -> dict[str, Any]:
        s = cfg.head_settings
        return {
            "projector_type": "domino",
            "shift_label": True,
            "pure_draft_prefix_len": s.pure_draft_prefix_len,
            "gru_hidden_dim": s.gru_hidden_dim,
            "emb_dim": s.emb_dim,
        }

    def zlab_fields(self, cfg: Any) -> dict[str, Any]:
        return {"emb_dim": cfg.head_settings.emb_dim}  # the references' checkpoints repeat it at the top level

    def speculators_fields(self, cfg: Any) -> dict[str, Any]:
        raise ConfigError(
            "a Domino drafter: speculators has no Domino model — export it with --to zlab (Model-Optimizer's and "
            "SpecForge's layout, which SGLang serves)"
        )

    def gguf_problems(self, cfg: Any) -> list[str]:
        return ["llama.cpp has no Domino drafter (its dflash graph has no GRU correction head)"]

    # ------------------------------------------------------------------ inspect
    def describe(self, facts: dict[str, Any], block_size: Any) -> str:
        d = facts.get("heads")
        if not d or not isinstance(block_size, int):
            return super().describe(facts, block_size)
        return (
            f" (Domino: {block_size} drafts a round; GRU {d['gru_hidden_dim']}, correction width {d['emb_dim']}, "
            f"first {d['pure_draft_prefix_len']} uncorrected)"
        )

    def inspect_facts(self, tensors: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
        hh = tensors.get("prefix_gru.weight_hh_l0")
        e = tensors.get("embed_proj.0.weight")
        s = cfg.head_settings if cfg else None
        return {
            "gru_hidden_dim": hh["shape"][1] if hh else (s.gru_hidden_dim if s else None),
            "emb_dim": e["shape"][0] if e else (s.emb_dim if s else None),
            "pure_draft_prefix_len": s.pure_draft_prefix_len if s else None,
        }


class DominoHead(Head):
    """Slot k drafts the token at a + k + 1 (as DSpark), so a block of bs slots drafts bs tokens."""

    kind: ClassVar[str] = "domino"
    settings: ClassVar[type | None] = DominoSettings
    train_settings: ClassVar[type | None] = DominoTrainSettings
    first_draft_slot: ClassVar[int] = 0
    format: ClassVar[HeadFormat] = DominoFormat(
        title="Domino",
        zlab_field_types={
            "projector_type": (STR, True),
            "shift_label": (BOOL, True),
            "gru_hidden_dim": (INT, False),
            "emb_dim": (INT, False),
            "pure_draft_prefix_len": (INT, True),
        },
        vllm_problem=VLLM_PROBLEM,
        vllm_cpu_problem=VLLM_PROBLEM,
        zlab_problem="z-lab's DFlashDraftModel has no Domino correction head",
        deepspec_problem=(
            "a Domino drafter: DeepSpec's Qwen3DSparkModel has no GRU correction head — export it with --to zlab"
        ),
        # the quickstart's budget: a correction sized to the small default target
        quickstart_drafter={"gru_hidden_dim": 128, "emb_dim": 128},
    )

    # ------------------------------------------------------------------ config
    def check_config(self, cfg: Any, where: Any) -> None:
        prefix = cfg.head_settings.pure_draft_prefix_len
        if prefix >= cfg.block_size:
            raise fail(
                where("pure_draft_prefix_len"),
                "pure_draft_prefix_len",
                prefix,
                f"below block_size {cfg.block_size} (at least one slot of a block is corrected)",
            )

    def extra_parameters(self, cfg: Any) -> int:
        """GRU (3G·H + 3G·G), projection (E·(H + G) + V'·E)."""
        h, g, e = cfg.hidden_size, cfg.head_settings.gru_hidden_dim, cfg.head_settings.emb_dim
        return 3 * g * (h + g) + e * (h + g) + (cfg.draft_vocab_size or cfg.vocab_size) * e

    def add_modules(self, drafter: Any) -> None:
        from dflashkit.drafter.heads.domino_net import build_correction

        build_correction(drafter)

    def reset(self, drafter: Any, std: float) -> None:
        from dflashkit.drafter.heads.domino_net import reset_correction

        reset_correction(drafter, std)

    # ------------------------------------------------------------------ training
    def train_checks(self, train_cfg: Any, drafter_cfg: Any) -> None:
        for name, value, ok, why in (
            ("loss", train_cfg.loss, "ce", "Domino trains CE of its corrected and its backbone logits"),
            ("position_weights", train_cfg.position_weights, "decay", "the references weight slots by exp(−k/γ)"),
            ("fsdp", train_cfg.fsdp, False, "its GRU and projection run outside the sharded forward"),
        ):
            if value != ok:
                raise ConfigError(f"{name}: {value!r} cannot train a Domino drafter (drafter.kind: domino): {why}")

    def objective(self, terms: TrainingTerms) -> HeadObjective | None:
        """(1 − λ)·CE(corrected) + λ·CE(backbone) (domino_loss.py), replacing the backbone's objective."""
        from dflashkit.drafter.heads.domino_loss import domino_terms, lambda_base_at

        sums = domino_terms(
            terms.drafter, terms.hidden, terms.head_weight, terms.labels, terms.prev_tokens, terms.weights,
            terms.embed_weight,
        )  # fmt: skip
        lam = lambda_base_at(self.train_options(terms.train_cfg), terms.step, terms.total_steps, terms.progress)
        loss = ((1.0 - lam) * sums.final + lam * sums.base) / terms.normalizer
        return HeadObjective(loss=loss, correct_counts=sums.correct, valid_counts=sums.counted)

    # ------------------------------------------------------------------ decoding
    def draft_round(self, r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        from dflashkit.drafter.heads.domino_draft import draft_domino

        return draft_domino(r)

    def tree_conditional(
        self, drafter: Any, draft_logits: Tensor, hidden: Tensor, embed_weight: Tensor, block: Any = None
    ) -> Any:
        """Each node's children ranked by the corrected distribution given the whole path to it."""
        from dflashkit.drafter.heads.domino_draft import domino_conditional

        return domino_conditional(drafter, draft_logits, hidden, embed_weight)

    def greedy_drafts(
        self,
        drafter: Any,
        draft_logits: Tensor,
        first_prev: int,
        hidden: Tensor,
        embed_weight: Tensor,
        block: Any = None,
    ) -> tuple[list[int], Tensor]:
        from dflashkit.drafter.heads.domino_draft import greedy_chain

        return greedy_chain(drafter, draft_logits, first_prev, hidden, embed_weight)

    def teacher_forced_logits(
        self,
        drafter: Any,
        draft_logits: Tensor,
        prev_tokens: Tensor,
        hidden: Tensor,
        embed_weight: Tensor,
        block: Any = None,
    ) -> Tensor:
        from dflashkit.drafter.heads.domino_draft import teacher_forced

        return teacher_forced(drafter, draft_logits, prev_tokens, hidden, embed_weight)


__all__ = ["DominoFormat", "DominoHead", "DominoSettings", "DominoTrainSettings"]
