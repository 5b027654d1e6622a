"""DeepSpec's own layout of a DSpark drafter, both ways: what `Qwen3DSparkModel.from_pretrained(dir)` loads and runs
as it is (deepseek-ai/DeepSpec `deepspec/modeling/dspark/qwen3/{config,modeling}.py`, `deepspec/eval/dspark/
evaluator.py`), and its checkpoints read back as dflashkit's own.

    dflashkit convert CKPT OUT --to deepspec --target T     # dflashkit DSpark → DeepSpec (needs the target's tables)
    dflashkit convert DEEPSPEC_CKPT OUT --target T          # DeepSpec → dflashkit (tables checked against T, dropped)

What DeepSpec's model holds beyond dflashkit's tensors, and how each is translated:
- `embed_tokens.weight` and `lm_head.weight`: full-vocabulary copies of the target's tables, frozen in training and
  loaded from the draft directory at evaluation (DeepSpec never re-reads them from the target there), so an export
  must write them. On import they are compared with the target's (when given) and dropped.
- the mask: DeepSpec embeds the block [anchor, mask × (γ − 1)] through its own `embed_tokens`, so a learned mask
  embedding is written into the row `mask_token_id` of that copy — moved first to a token no chat produces
  (`safe_learned_mask_id`), so no real anchor meets the substituted row. The config keeps
  `dflash_config.mask_embedding: true`, and an import takes that row back as the learned vector, exactly.
- config.json: dflashkit's DSpark fields (`Qwen3DSparkModel`, `markov_rank`, `markov_head_type`,
  `enable_confidence_head`, `confidence_head_with_markov`, top-level `target_layer_ids`, `mask_token_id`) plus
  `num_anchors`, which DeepSpec's constructor requires (a training setting; 512 is written).
What cannot be written exactly is refused: a draft vocabulary (DeepSpec drafts over the whole vocabulary, so the ids
outside it would be drafted) and DFlash drafters (DeepSpec's models are DSpark-layout: every slot drafts).
"""

from __future__ import annotations

from typing import Any

import torch

from dflashkit.drafter.checkpoint import target_copies
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.errors import CheckpointError, ConfigError

DEEPSPEC_FORMAT = "deepspec"
NUM_ANCHORS = 512  # DeepSpec's constructor requires the field; it only sizes training batches


def deepspec_problems(cfg: DrafterConfig) -> list[str]:
    """Why a drafter cannot be written in DeepSpec's layout exactly (empty: it can)."""
    problems = []
    if head_of(cfg).format.deepspec_problem:
        problems.append(head_of(cfg).format.deepspec_problem)
    if cfg.draft_vocab_size is not None:
        problems.append(
            f"a draft vocabulary of {cfg.draft_vocab_size} ids: DeepSpec drafts over the whole vocabulary, so the "
            f"other ids would be drafted too — train with draft_vocab_size: null for DeepSpec"
        )
    return problems


def deepspec_config(cfg: DrafterConfig) -> dict[str, Any]:
    """config.json as DeepSpec's build_draft_config writes it, for dflashkit's drafter geometry."""
    return {**cfg.to_zlab_dict(), "num_anchors": NUM_ANCHORS}


def deepspec_tensors(cfg: DrafterConfig, tensors: dict[str, torch.Tensor], target: Any) -> dict[str, torch.Tensor]:
    """dflashkit's tensors + the target's tables (a learned mask in row cfg.mask_token_id of the embeddings)."""
    if target is None:
        raise ConfigError(
            "--to deepspec needs --target: DeepSpec loads the target's embeddings and LM head from the draft directory"
        )
    embed = target.embed_weight.detach().cpu().float().clone()  # (V, H)
    if cfg.learned_mask_embedding:
        embed[cfg.mask_token_id] = tensors["mask_embedding"].float()
    out = {k: v for k, v in tensors.items() if k not in ("mask_embedding", "draft_to_target")}
    dtype = tensors["fc.weight"].dtype
    out["embed_tokens.weight"] = embed.to(dtype)
    out["lm_head.weight"] = target.lm_head_weight.detach().cpu().to(dtype).clone()  # (V, H)
    return out


def import_tables(
    tensors: dict[str, torch.Tensor], cfg: DrafterConfig, target: Any, notes: list[str], source: str
) -> dict[str, torch.Tensor]:
    """A DeepSpec checkpoint's copies of the target's tables, dropped: a learned mask (config
    `dflash_config.mask_embedding`) is taken back from its row of the embeddings; the rest is compared with the
    target when one is given (to the copy's precision) — a drafter trained against another target is refused."""
    copies = target_copies(tensors, cfg)
    if not copies:
        return tensors
    out = {k: v for k, v in tensors.items() if k not in copies}
    rows = torch.ones(cfg.vocab_size, dtype=torch.bool)
    if cfg.learned_mask_embedding and "mask_embedding" not in tensors and "embed_tokens.weight" in copies:
        out["mask_embedding"] = copies["embed_tokens.weight"][cfg.mask_token_id].clone()  # (H,)
        rows[cfg.mask_token_id] = False
        notes.append(f"learned mask embedding: row {cfg.mask_token_id} of embed_tokens.weight")
    for key, copy in copies.items():
        shape = list(copy.shape)
        if target is None:
            notes.append(
                f"dropped {key} {shape}: DeepSpec's frozen copy of the target's table, not compared with the target "
                f"(pass --target T to check it)"
            )
            continue
        ref = (target.embed_weight if key.startswith("embed") else target.lm_head_weight).detach().cpu()
        ref = ref.to(copy.dtype).float()
        keep = rows if key.startswith("embed") else torch.ones_like(rows)
        worst = float((copy.float() - ref)[keep].abs().max())
        if worst > torch.finfo(copy.dtype).eps * float(ref.abs().max()):
            raise CheckpointError(
                f"{source}: tensor '{key}' differs from the target's table (max |Δ| {worst:.3g}): this drafter was "
                f"trained with another target, or with that table unfrozen — dflashkit runs a DSpark drafter with the "
                f"target's own tables"
            )
        notes.append(f"dropped {key} {shape}: equal to the target's table (to {copy.dtype} precision)")
    return out


__all__ = [
    "DEEPSPEC_FORMAT",
    "NUM_ANCHORS",
    "deepspec_config",
    "deepspec_problems",
    "deepspec_tensors",
    "import_tables",
]
