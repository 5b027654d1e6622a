"""The DFlash2 head (z-lab's DFlash2): grouped dynamic causal convolutions around every sublayer of the backbone and
a low-rank candidate selector that re-ranks each draft slot's top-K unary candidates given the token before it.

Its network is in `dflash2_net.py`, its drafting (the selector's walk, the DDTree lattice) in `dflash2_draft.py`, its
selector term of the training loss in `dflash2_loss.py`; this module is what the stages ask about it.

Vocabulary: the references run DFlash2 over the target's whole vocabulary. With a reduced draft vocabulary the
unary logits and the candidates are draft ids, the successor codebook B has one row per draft id and the predecessor
codebook A one per target id (a predecessor is any target token: the bonus, or a draft mapped through the id map).
The z-lab and GGUF layouts then carry the id map (`draft_to_target` / `d2t`) and B spread over the target's rows
(zeros outside the draft vocabulary), which llama.cpp's graph reads; speculators refuses a reduced vocabulary for
DFlash2, and so does `convert --to speculators`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from dflashkit.drafter.config_fields import FLOAT, INT
from dflashkit.drafter.heads.base import DraftRound, Head, TrainingTerms
from dflashkit.drafter.heads.format import HeadFormat
from dflashkit.errors import ConfigError
from dflashkit.validation import (
    Bool,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    choice,
    fail,
    optional,
)


@dataclass(kw_only=True)
class DFlash2Settings:
    """drafter.kind: dflash2 — its fields of the drafter config (held as a DFlash2 config's `head_settings`)."""

    conv_kernel_size: PositiveInt = 2  # taps of the grouped dynamic causal convolution around each attention and MLP
    conv_group_size: PositiveInt = 16  # channels that share one dynamic kernel
    selector_rank: PositiveInt = 256  # rank of the candidate selector's codebooks
    selector_top_k: PositiveInt = 16  # unary candidates the selector re-ranks per slot, given the token before it
    output_multiplier: PositiveFloat = 1.0  # unary logits = the LM head's × this
    final_logit_softcapping: optional(PositiveFloat, "no softcap") = None  # then tanh-capped at this
    input_embedding_scale: PositiveFloat = 1.0  # the block's embeddings × this


@dataclass(kw_only=True)
class DFlash2TrainSettings:
    """drafter.kind: dflash2 — its training options (held in `TrainConfig.head_options["dflash2"]`)."""

    # drafter.kind: dflash2 — the candidate selector's K-way CE, added to the unary objective with weight
    # selector_weight (0 during selector_warmup_steps, then a linear ramp over selector_ramp_steps). "inject": a gold
    # token outside the top-K replaces the K-th candidate (speculators, Model-Optimizer); "strict": that slot adds
    # nothing. selector_decay: the unary objective's slot weights (speculators); false: every slot 1 (Model-Optimizer)
    selector_weight: NonNegativeFloat = 1.0
    selector_rule: choice("inject", "strict") = "inject"  # drafter.kind: dflash2 — a gold token outside the top-K
    selector_decay: Bool = True  # drafter.kind: dflash2 — selector term weighted like the unary one (false: uniform)
    selector_warmup_steps: NonNegativeInt = 0  # drafter.kind: dflash2 — steps with selector weight 0
    selector_ramp_steps: NonNegativeInt = 0  # drafter.kind: dflash2 — then a linear ramp to selector_weight


# dflashkit key → llama.cpp tensor name (gguf-py tensor_mapping: DFlash2's conv and selector tensors)
GGUF_GLOBAL = {
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
GGUF_LAYER = {
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}


_FIELDS = tuple(f.name for f in dataclasses.fields(DFlash2Settings))


class DFlash2Format(HeadFormat):
    """DFlash2's layouts: z-lab's DFlash2DraftModel config.json (its fields in `dflash_config`), speculators'
    DFlash2DraftModel, llama.cpp's convolution and selector tensors."""

    # ------------------------------------------------------------------ config.json layouts
    def fields_from_zlab(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        dflash = raw.get("dflash_config") or {}
        out = {}
        for name in _FIELDS:
            value = dflash.get(name, raw.get(name))
            if value is not None:
                out[name] = value
        missing = [n for n in _FIELDS[:4] if n not in out]
        if missing:
            raise ConfigError(f"{source}: a DFlash2 drafter needs dflash_config.{missing[0]} (an integer ≥ 1)")
        if out.get("final_logit_softcapping") is not None and float(out["final_logit_softcapping"]) <= 0:
            out["final_logit_softcapping"] = None  # z-lab's and llama.cpp's reading: ≤ 0 means no cap
        return out

    def zlab_dflash_fields(self, cfg: Any) -> dict[str, Any]:
        """Its fields inside `dflash_config`, where z-lab's model and llama.cpp's converter read them."""
        out = cfg.head_fields()
        if out["final_logit_softcapping"] is None:
            del out["final_logit_softcapping"]
        return out

    def speculators_fields(self, cfg: Any) -> dict[str, Any]:
        if cfg.draft_vocab_size is not None:
            raise ConfigError(
                f"draft_vocab_size {cfg.draft_vocab_size}: speculators runs DFlash2 over the target's whole "
                f"vocabulary only (its DFlash2DraftModel refuses a draft vocabulary); export with --to zlab or "
                f"--to gguf, or train with the whole vocabulary"
            )
        s = cfg.head_settings
        if s.output_multiplier != 1.0 or s.final_logit_softcapping is not None or s.input_embedding_scale != 1.0:
            raise ConfigError(
                "output_multiplier, final_logit_softcapping or input_embedding_scale set: speculators' DFlash2 has no "
                "such fields and would draft differently; export with --to zlab or --to gguf"
            )
        return {name: getattr(s, name) for name in _FIELDS[:4]}

    def fields_from_speculators(self, raw: dict[str, Any], source: str) -> dict[str, Any]:
        """DrafterConfig fields of a speculators DFlash2 config (its defaults where a field is absent)."""
        defaults = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
        return {n: int(raw.get(n) or d) for n, d in defaults.items()}

    # ------------------------------------------------------------------ GGUF (llama.cpp's dflash architecture)
    def gguf_keys(self, cfg: Any) -> dict[str, Any]:
        s = cfg.head_settings
        out: dict[str, Any] = {
            "conv_kernel_size": int(s.conv_kernel_size),
            "conv_group_size": int(s.conv_group_size),
            "selector_rank": int(s.selector_rank),
            "selector_top_k": int(s.selector_top_k),
            "logit_scale": float(s.output_multiplier),
            "embedding_scale": float(s.input_embedding_scale),
        }
        if s.final_logit_softcapping is not None:
            out["final_logit_softcapping"] = float(s.final_logit_softcapping)
        return out

    def gguf_tensors(self, cfg: Any, tensors: dict[str, Tensor]) -> dict[str, tuple[str, Tensor, bool]]:
        """Its tensors as llama.cpp names them (the base kernels kept F32, as its converter does); B spread over the
        target's vocabulary through the id map when the draft vocabulary is reduced."""
        out = {}
        for key, t in tensors.items():
            if key in GGUF_GLOBAL:
                if key.endswith("successor_codebook") and "draft_to_target" in tensors:  # names only: no map given
                    full = torch.zeros(cfg.vocab_size, t.shape[1], dtype=t.dtype)
                    t = full.index_copy_(0, tensors["draft_to_target"].long(), t)
                out[key] = (GGUF_GLOBAL[key], t, False)
                continue
            parts = key.split(".", 2)
            if len(parts) == 3 and parts[0] == "layers" and parts[2] in GGUF_LAYER:
                out[key] = (f"blk.{parts[1]}.{GGUF_LAYER[parts[2]]}", t, parts[2].endswith("base_kernel"))
        return out

    def gguf_problems(self, cfg: Any) -> list[str]:
        k = cfg.head_settings.selector_top_k
        need = k * (k + 1)
        if cfg.hidden_size < need:
            return [
                f"hidden_size {cfg.hidden_size} < selector_top_k·(selector_top_k + 1) = {need}: llama.cpp returns "
                f"each slot's K candidates and K² scores in a row of hidden_size floats"
            ]
        return []

    # ------------------------------------------------------------------ inspect
    def describe(self, facts: dict[str, Any], block_size: Any) -> str:
        d = facts.get("heads")
        if not d or not isinstance(block_size, int):
            return super().describe(facts, block_size)
        return (
            f" (DFlash2: {block_size - 1} drafts a round; convolutions of {d['conv_kernel_size']} taps, selector rank "
            f"{d['selector_rank']} over the top-{d['selector_top_k']})"
        )

    def inspect_facts(self, tensors: dict[str, Any], cfg: Any) -> dict[str, Any] | None:
        base = tensors.get("layers.0.attention_conv.base_kernel")
        a = tensors.get("candidate_selector.predecessor_codebook")
        s = cfg.head_settings if cfg else None
        return {
            "conv_kernel_size": base["shape"][1] if base else (s.conv_kernel_size if s else None),
            "selector_rank": a["shape"][1] if a else (s.selector_rank if s else None),
            "selector_top_k": s.selector_top_k if s else None,
        }


class DFlash2Head(Head):
    """Slot 0 holds the given token (as DFlash); slots 1 … bs − 1 draft through the selector's walk."""

    kind: ClassVar[str] = "dflash2"
    settings: ClassVar[type | None] = DFlash2Settings
    train_settings: ClassVar[type | None] = DFlash2TrainSettings
    format: ClassVar[HeadFormat] = DFlash2Format(
        title="DFlash2",
        zlab_field_types={
            "conv_kernel_size": (INT, False),
            "conv_group_size": (INT, False),
            "selector_rank": (INT, False),
            "selector_top_k": (INT, False),
            "output_multiplier": (FLOAT, True),
            "final_logit_softcapping": (FLOAT, True),
            "input_embedding_scale": (FLOAT, True),
        },
        architectures=("DFlash2DraftModel",),
        speculators_architecture="DFlash2DraftModel",
        key_aliases={
            f"candidate_selector.{n}_codebook.weight": f"candidate_selector.{n}_codebook"
            for n in ("predecessor", "successor")
        },
        vllm_cpu_problem=(
            "vLLM runs DFlash2 drafters (qwen3_dflash2) in its GPU model runner; the vLLM environment here is the CPU "
            "build — check a DFlash2 drafter with --engine llamacpp"
        ),
        vllm_gpu_layout="DFlash2DraftModel layout (qwen3_dflash2)",
        deepspec_problem=(
            "a DFlash2 drafter: DeepSpec's Qwen3DSparkModel has no convolutions or candidate selector — export it with "
            "--to zlab, --to speculators or --to gguf"
        ),
    )

    def check_config(self, cfg: Any, where: Any) -> None:
        s = cfg.head_settings
        if cfg.hidden_size % s.conv_group_size:
            raise fail(
                where("conv_group_size"),
                "conv_group_size",
                s.conv_group_size,
                f"a divisor of hidden_size {cfg.hidden_size} (channels share a dynamic kernel in groups)",
            )
        if s.conv_kernel_size > cfg.block_size:
            raise fail(
                where("conv_kernel_size"),
                "conv_kernel_size",
                s.conv_kernel_size,
                f"at most block_size {cfg.block_size} (taps stay within a block)",
            )
        if s.selector_top_k > (cfg.draft_vocab_size or cfg.vocab_size):
            raise fail(
                where("selector_top_k"),
                "selector_top_k",
                s.selector_top_k,
                f"at most the draft vocabulary ({cfg.draft_vocab_size or cfg.vocab_size} tokens)",
            )

    def scale_embeddings(self, cfg: Any, embeds: Tensor) -> Tensor:
        scale = cfg.head_settings.input_embedding_scale
        return embeds if scale == 1.0 else embeds * scale

    def unary_logits(self, cfg: Any, logits: Tensor) -> Tensor:
        from dflashkit.drafter.heads.dflash2_net import scaled_logits

        return scaled_logits(cfg, logits)

    def unary_weight(self, cfg: Any, weight: Tensor) -> Tensor:
        """m·(h·Wᵀ) = h·(m·W)ᵀ; a softcap is refused in training (`train_checks`)."""
        m = cfg.head_settings.output_multiplier
        return weight if m == 1.0 else weight * m

    def extra_parameters(self, cfg: Any) -> int:
        """Two convolutions a layer (base 2·K·H, projection H·2·K·G), codebooks A (V × r), B (V' × r), P (H × r)."""
        s = cfg.head_settings
        h, k, g = cfg.hidden_size, s.conv_kernel_size, cfg.hidden_size // s.conv_group_size
        conv = 2 * (2 * k * h + h * 2 * k * g)
        r = s.selector_rank
        return cfg.num_hidden_layers * conv + (cfg.vocab_size + (cfg.draft_vocab_size or cfg.vocab_size) + h) * r

    def add_modules(self, drafter: Any) -> None:
        from dflashkit.drafter.heads.dflash2_net import CandidateSelector, GroupedDynamicCausalConv

        cfg, s = drafter.config, drafter.config.head_settings
        for layer in drafter.layers:
            layer.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, s.conv_kernel_size, s.conv_group_size)
            layer.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, s.conv_kernel_size, s.conv_group_size)
        vocab = cfg.draft_vocab_size or cfg.vocab_size
        drafter.candidate_selector = CandidateSelector(
            cfg.vocab_size, vocab, cfg.hidden_size, s.selector_rank, s.selector_top_k
        )

    def reset(self, drafter: Any, std: float) -> None:
        for layer in drafter.layers:
            layer.attention_conv.reset_parameters()
            layer.mlp_conv.reset_parameters()
        drafter.candidate_selector.reset_parameters(std)

    # ------------------------------------------------------------------ training
    def train_checks(self, train_cfg: Any, drafter_cfg: Any) -> None:
        cap = drafter_cfg.head_settings.final_logit_softcapping
        if cap is not None:
            raise ConfigError(
                f"final_logit_softcapping {cap}: dflashkit's chunked objective "
                f"trains uncapped logits; drop it to train (a capped checkpoint still imports, drafts and exports)"
            )
        if train_cfg.fsdp:
            raise ConfigError(
                "fsdp: true cannot train a DFlash2 drafter: its selector runs outside the sharded forward"
            )
        if train_cfg.loss == "topk":
            raise ConfigError(
                "loss: 'topk' cannot train a DFlash2 drafter: the selector's candidates come from the drafter's own "
                "logits and its label is a token; use ce, kl, tv, nla or lk_hybrid"
            )

    def training_loss(self, terms: TrainingTerms) -> Tensor | None:
        from dflashkit.drafter.heads.dflash2_loss import selector_loss

        return selector_loss(terms, self.train_options(terms.train_cfg), terms.weights_of)

    # ------------------------------------------------------------------ decoding
    def draft_round(self, r: DraftRound) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        from dflashkit.drafter.heads.dflash2_draft import draft_dflash2

        return draft_dflash2(r)

    def tree_conditional(
        self, drafter: Any, draft_logits: Tensor, hidden: Tensor, embed_weight: Tensor, block: Any = None
    ) -> Any:
        """Each node's children ranked by the selector's scores given the node's own token (the selector lattice)."""
        from dflashkit.drafter.heads.dflash2_draft import lattice_conditional

        return lattice_conditional(drafter, hidden, draft_logits)

    def greedy_drafts(
        self,
        drafter: Any,
        draft_logits: Tensor,
        first_prev: int,
        hidden: Tensor,
        embed_weight: Tensor,
        block: Any = None,
    ) -> tuple[list[int], Tensor]:
        from dflashkit.drafter.heads.dflash2_draft import walk

        drafts, _, dense = walk(drafter, hidden, draft_logits, first_prev)
        return drafts, dense

    def teacher_forced_logits(
        self,
        drafter: Any,
        draft_logits: Tensor,
        prev_tokens: Tensor,
        hidden: Tensor,
        embed_weight: Tensor,
        block: Any = None,
    ) -> Tensor:
        from dflashkit.drafter.heads.dflash2_draft import teacher_forced_scores

        return teacher_forced_scores(drafter, hidden, draft_logits, prev_tokens)


__all__ = ["DFlash2Format", "DFlash2Head", "DFlash2Settings", "DFlash2TrainSettings"]
