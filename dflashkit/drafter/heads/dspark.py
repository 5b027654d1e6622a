"""The DSpark head (DeepSpec's design): every slot drafts, the backbone's logits corrected left to right by a
low-rank Markov head on the previous token, and a confidence head estimating acceptance.

Its network is in `dspark_net.py`, its objective in `dspark_loss.py`, its drafting round in `dspark_draft.py`;
this module is what the stages ask about it: its settings, its behaviour (`DSparkHead`) and its layouts
(`DSparkFormat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dflashkit.drafter.config_fields import BOOL, INT, STR
from dflashkit.drafter.heads.base import DraftRound, Head, HeadObjective, TrainingTerms
from dflashkit.drafter.heads.format import HeadFormat
from dflashkit.errors import ConfigError
from dflashkit.validation import Bool, NonNegativeFloat, PositiveInt


@dataclass(kw_only=True)
class DSparkSettings:
    """drafter.kind: dspark — its fields of the drafter config (held as a DSpark config's `head_settings`)."""

    markov_rank: PositiveInt = 256  # rank of the Markov head's bias from the previous token
    confidence_head: Bool = True  # a confidence head estimating each slot's acceptance


@dataclass(kw_only=True)
class DSparkTrainSettings:
    """drafter.kind: dspark — its training options (held in `TrainConfig.head_options["dspark"]`)."""

    # drafter.kind: dspark — the weights of its loss terms (DeepSpec's defaults): CE to the label, L1 distance to
    # the target's distribution, BCE of the confidence head against the acceptance rate 1 − L1/2
    dspark_ce_weight: NonNegativeFloat = 0.1
    dspark_l1_weight: NonNegativeFloat = 0.9  # drafter.kind: dspark — weight of the L1 term
    dspark_confidence_weight: NonNegativeFloat = 1.0  # drafter.kind: dspark — weight of the confidence BCE


GGUF_NAMES = {
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}


class DSparkFormat(HeadFormat):
    """DSpark's layouts: DeepSpec's Qwen3DSparkModel config.json (read by vLLM and llama.cpp's converter), speculators'
    DSparkSpeculator, llama.cpp's Markov and confidence tensors."""

    def speculators_fields(self, cfg: Any) -> dict[str, Any]:
        s = cfg.head_settings
        return {
            "markov_rank": s.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": s.confidence_head,
            "confidence_head_with_markov": s.confidence_head,
        }

    def gguf_keys(self, cfg: Any) -> dict[str, bool | int | float]:
        return {"sample_from_anchor": True, "has_confidence_head": bool(cfg.head_settings.confidence_head)}

    def gguf_tensors(self, cfg: Any, tensors: dict[str, Tensor]) -> dict[str, tuple[str, Tensor, bool]]:
        """gguf-py constants DSPARK_MARKOV_W1 / _W2 / DSPARK_CONF_PROJ."""
        return {k: (GGUF_NAMES[k], t, False) for k, t in tensors.items() if k in GGUF_NAMES}

    def fields_from_speculators(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """A speculators DSpark config, refusing (by name) what dflashkit cannot run."""
        if not raw.get("markov_rank"):
            raise ConfigError(
                f"{source}: markov_rank {raw.get('markov_rank')!r} — a DSpark drafter without a Markov head; "
                f"dflashkit's DSpark needs markov_rank ≥ 1"
            )
        self.fields_from_zlab({"sample_from_anchor": True, **raw}, source)  # the variants it can run
        return {
            "markov_rank": int(raw["markov_rank"]),
            "confidence_head": bool(raw.get("enable_confidence_head", False)),
        }

    def describe(self, facts: dict[str, Any], block_size: Any) -> str:
        d = facts.get("heads")
        if not d:
            return super().describe(facts, block_size)
        conf = "a" if d["confidence_head"] else "no"
        return f" (DSpark: {block_size} drafts a round; Markov head rank {d['markov_rank']}, {conf} confidence head)"

    def inspect_facts(self, tensors: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
        w1 = tensors.get("markov_head.markov_w1.weight")
        return {
            "markov_rank": w1["shape"][1] if w1 else (cfg.head_settings.markov_rank if cfg else None),
            "confidence_head": "confidence_head.proj.weight" in tensors,
        }

    def serving_note(self, cfg: Any) -> str | None:
        return "DSpark: vLLM runs it with method 'dspark' in its GPU model runner only (Qwen3DSparkModel)" + (
            "; its DSpark model ignores a learned mask embedding (mask_embedding.pt too) and would run another "
            "drafter — llama.cpp runs this one (--to gguf, --spec-type draft-dspark)"
            if cfg.learned_mask_embedding
            else ""
        )

    def recognises(self, raw: dict[str, Any]) -> bool:
        """DeepSpec's and llama.cpp's DSpark configs: a `markov_rank`, or a DSpark architecture."""
        return raw.get("markov_rank") is not None or any("DSpark" in str(a) for a in raw.get("architectures") or [])

    def fields_from_zlab(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """A DSpark config dflashkit can run: a vanilla Markov head of rank ≥ 1, every slot drafting, the confidence
        head (if any) reading [hidden; W1[previous token]] — the layout DeepSpec trains and llama.cpp runs."""
        other = [a for a in raw.get("architectures") or [] if a in ("DSparkDraftModel", "DSparkV41DraftModel")]
        if other:
            raise ConfigError(
                f"{source}: architectures {other} is DeepSeek-V4's DSpark backbone (MLA + MoE stages); dflashkit "
                f"runs the Qwen3-style DFlash backbone (Qwen3DSparkModel)"
            )
        if not raw.get("markov_rank"):
            raise ConfigError(f"{source}: a DSpark drafter needs 'markov_rank' ≥ 1 (the Markov head's rank)")
        kind = raw.get("markov_head_type", "vanilla")
        if kind != "vanilla":
            raise ConfigError(
                f"{source}: markov_head_type {kind!r} is not supported; dflashkit runs the 'vanilla' Markov head "
                f"(logits + W2·W1[previous token])"
            )
        if raw.get("sample_from_anchor", True) is not True:
            raise ConfigError(
                f"{source}: sample_from_anchor false (a bonus-anchor block, EAGLE-3 style) is not supported; "
                f"dflashkit's DSpark drafts from every slot"
            )
        if raw.get("enable_confidence_head") and raw.get("confidence_head_with_markov", True) is not True:
            raise ConfigError(
                f"{source}: confidence_head_with_markov false is not supported (the confidence head reads "
                f"[hidden; W1[previous token]])"
            )
        return {
            "markov_rank": int(raw.get("markov_rank") or 256),
            "confidence_head": bool(raw.get("enable_confidence_head", True)),
        }

    def zlab_fields(self, cfg: Any) -> dict[str, Any]:
        """As DeepSpec, vLLM and llama.cpp's converter read a DSpark config."""
        return {
            "markov_rank": cfg.head_settings.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": cfg.head_settings.confidence_head,
            "confidence_head_with_markov": True,
            "sample_from_anchor": True,
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": cfg.mask_token_id,
        }


class DSparkHead(Head):
    """Slot k drafts the token at a + k + 1 (shifted by one against DFlash), so a block of bs drafts bs tokens."""

    kind: ClassVar[str] = "dspark"
    settings: ClassVar[type | None] = DSparkSettings
    train_settings: ClassVar[type | None] = DSparkTrainSettings
    first_draft_slot: ClassVar[int] = 0
    reads_final_layer: ClassVar[bool] = True  # its L1 term reads the target's distribution
    training_needs_target: ClassVar[bool] = True  # the target's LM head forms that distribution every step
    confidence_gate: ClassVar[bool] = True  # its confidence head predicts each slot's acceptance
    format: ClassVar[HeadFormat] = DSparkFormat(
        title="DSpark",
        architectures=("Qwen3DSparkModel",),
        zlab_field_types={
            "markov_rank": (INT, True),
            "markov_head_type": (STR, True),
            "enable_confidence_head": (BOOL, True),
            "confidence_head_with_markov": (BOOL, True),
            "sample_from_anchor": (BOOL, True),
        },
        speculators_architecture="DSparkSpeculator",
        carries_target_tables=True,  # DeepSpec saves frozen copies of the embeddings and LM head
        llamacpp_spec_type="draft-dspark",
        vllm_cpu_problem=(
            "vLLM runs DSpark drafters only in its GPU model runner (v1/worker/gpu/spec_decode/dspark); the vLLM "
            "environment here is the CPU build — check a DSpark drafter with --engine llamacpp"
        ),
        vllm_gpu_layout="Qwen3DSparkModel layout (method 'dspark')",
        vllm_drops_learned_mask=True,  # qwen3_dspark.py embeds masked slots with the mask token's row
        zlab_problem="z-lab's DFlashDraftModel has no Markov or confidence head",
        deepspec_problem=None,
        # the quickstart's budget: Markov rank 64 and CE weight 1.0 instead of DeepSpec's 256 and 0.1
        # (docs/studies.md, "DSpark CE weight"); given values win, and `dflashkit train` keeps DeepSpec's defaults
        quickstart_drafter={"markov_rank": 64},
        quickstart_train={"dspark_ce_weight": 1.0},
    )

    def extra_parameters(self, cfg: Any) -> int:
        """Markov W1 (V × r), W2 (r → V'), confidence head (H + r → 1)."""
        r = cfg.head_settings.markov_rank
        out = cfg.vocab_size * r + r * (cfg.draft_vocab_size or cfg.vocab_size)
        return out + ((cfg.hidden_size + r + 1) if cfg.head_settings.confidence_head else 0)

    def reads_target_lse(self, draft_vocab_size: int | None, target: Any) -> bool:
        """With a draft vocabulary on a target whose logits are final_norm(h) · Wᵀ (`Target.plain_head`), its loss
        forms the draft ids' logits only and reads the log-sum-exp over the whole vocabulary from the capture."""
        return bool(draft_vocab_size) and bool(getattr(target, "plain_head", False))

    def train_checks(self, train_cfg: Any, drafter_cfg: Any) -> None:
        for name, value, ok, why in (
            ("loss", train_cfg.loss, "ce", "a DSpark drafter trains on its own loss (CE + L1 to the target + BCE)"),
            ("fsdp", train_cfg.fsdp, False, "its Markov and confidence heads run outside the sharded forward"),
        ):
            if value != ok:
                raise ConfigError(f"{name}: {value!r} cannot train a DSpark drafter (drafter.kind: dspark): {why}")
        options = self.train_options(train_cfg)
        if all(getattr(options, name) == 0 for name in self.train_fields):
            raise ConfigError(
                f"{', '.join(self.train_fields)} are all 0: the objective trains nothing; "
                f"give at least one a weight > 0"
            )

    def objective(self, terms: TrainingTerms) -> HeadObjective | None:
        """CE to the label + L1 to the target's distribution + the confidence head's BCE (dspark_loss.py), replacing
        the backbone's objective."""
        from dflashkit.drafter.heads.dspark_loss import dspark_objective

        return dspark_objective(terms, self.train_options(terms.train_cfg))

    def add_modules(self, drafter: Any) -> None:
        from dflashkit.drafter.heads.dspark_net import ConfidenceHead, MarkovHead

        cfg = drafter.config
        rank = cfg.head_settings.markov_rank
        drafter.markov_head = MarkovHead(cfg.vocab_size, rank, cfg.draft_vocab_size or cfg.vocab_size)
        if cfg.head_settings.confidence_head:
            drafter.confidence_head = ConfidenceHead(cfg.hidden_size, rank)

    def reset(self, drafter: Any, std: float) -> None:
        drafter.markov_head.reset_parameters(std)

    def draft_round(self, r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """The backbone pass, then the Markov head left to right (dspark_draft.py); every slot drafts."""
        from dflashkit.drafter.heads.dspark_draft import draft_dspark

        drafts, q, logits = draft_dspark(r)
        return drafts, q, logits, logits[:, :0]  # its DDTree children need no hidden states

    def tree_conditional(
        self, drafter: Any, draft_logits: Tensor, hidden: Tensor, embed_weight: Tensor, block: Any = None
    ) -> Any:
        """Children ranked by the Markov-corrected distribution given the node's own token."""
        from dflashkit.drafter.heads.dspark_draft import dspark_conditional

        return dspark_conditional(draft_logits, drafter)

    def greedy_drafts(
        self,
        drafter: Any,
        draft_logits: Tensor,
        first_prev: int,
        hidden: Tensor,
        embed_weight: Tensor,
        block: Any = None,
    ) -> tuple[list[int], Tensor]:
        """The Markov head's greedy chain over the block (as llama.cpp's graph runs it): (drafts as target ids, the
        corrected logits (n, V'))."""
        from dflashkit.drafter.heads.dspark_net import markov_chain

        to_target = lambda i: int(drafter.to_target_ids(torch.tensor(i)))  # noqa: E731
        argmax = lambda z: int(z.argmax())  # noqa: E731
        drafts, corrected, _ = markov_chain(draft_logits, first_prev, drafter.markov_head, argmax, to_target)
        return drafts, corrected

    def teacher_forced_logits(
        self,
        drafter: Any,
        draft_logits: Tensor,
        prev_tokens: Tensor,
        hidden: Tensor,
        embed_weight: Tensor,
        block: Any = None,
    ) -> Tensor:
        """Slot j corrected by the Markov bias of the true token before it."""
        return draft_logits + drafter.markov_head.bias(prev_tokens).float()


__all__ = ["DSparkFormat", "DSparkHead", "DSparkSettings", "DSparkTrainSettings"]
