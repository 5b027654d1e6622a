"""The serving layout: a drafter directory vLLM loads as it is (`method: "dflash"`), and dflashkit loads back.

    dflashkit convert RUN/drafter OUT --to vllm --target TARGET      # TARGET: the HF target (its LM-head rows)
    export_serving(src, out, lm_head_weight=target.lm_head_weight)

What vLLM reads (vllm `model_executor/models/qwen3_dflash.py`, `config/speculative.py`, read for facts):
- config.json: z-lab's fields (`architectures: [DFlashDraftModel]`, `dflash_config.{mask_token_id,
  target_layer_ids}`, `block_size`, the Qwen3 geometry, `layer_types`, `sliding_window`) and, for a reduced
  vocabulary, a top-level `draft_vocab_size` (it ignores `dflash_config.draft_vocab_size`). `dflash_config.causal`
  overrides the per-layer causality it otherwise derives from `layer_types` (sliding → causal), so an explicit
  `is_causal` is written there too. `num_speculative_tokens` = block_size − 1.
- weights: the drafter's own keys; for a reduced vocabulary `d2t` (int64 OFFSETS: target id = draft id + d2t)
  and `lm_head.weight` (draft_vocab × H: the target's LM-head rows of the draft ids — vLLM computes draft logits
  with the drafter's own head and scatters them to target ids); a full-vocabulary drafter ships no head and no
  embeddings (vLLM shares the target's). A `draft_to_target` tensor makes vLLM refuse the checkpoint.
- a learned mask embedding only from `mask_embedding.pt` ({mask_token_id, embedding}) next to the weights; vLLM
  drops a `mask_embedding` tensor in the safetensors without a word and feeds the target's row mask_token_id —
  acceptance falls, output stays identical, nothing looks broken. vLLM substitutes the vector wherever the input
  id is mask_token_id, the block's first (real) token included, so the export points mask_token_id at a token no
  chat produces when the target's tokenizer is at hand (dflashkit itself ignores the id for a learned mask).
dflashkit's loader reads this layout back (drafter/checkpoint.py `from_serving_layout`): the round trip is exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflashkit.drafter.checkpoint import CONFIG_NAME, MASK_FILE, WEIGHTS_NAME
from dflashkit.drafter.config import SLIDING_ATTENTION, DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.errors import CheckpointError
from dflashkit.io_utils import atomic_path, atomic_write_text

SERVING_FORMAT = "vllm"


def vllm_model_problems(cfg: DrafterConfig) -> list[str]:
    """Why vLLM's drafter models cannot run this drafter (empty when they can)."""
    out = [head_of(cfg).format.vllm_problem] if head_of(cfg).format.vllm_problem else []
    if cfg.hidden_act != "silu":
        out.append(f"hidden_act {cfg.hidden_act!r}: vLLM's drafter MLP runs silu only")
    return out


def mixed_layers(cfg: DrafterConfig) -> bool:
    kinds = set(cfg.layer_types)
    return SLIDING_ATTENTION in kinds and len(kinds) > 1


def serving_config(cfg: DrafterConfig) -> dict[str, Any]:
    """config.json of the serving layout: z-lab's fields plus the ones vLLM reads at the top level."""
    config = cfg.to_zlab_dict()
    if cfg.draft_vocab_size is not None:
        config["draft_vocab_size"] = cfg.draft_vocab_size
    if cfg.is_causal is not None:
        config["dflash_config"]["causal"] = bool(cfg.is_causal)
    config["dflash_config"].setdefault("dflashkit", {})["layout"] = SERVING_FORMAT
    return config


def serving_tensors(
    cfg: DrafterConfig, tensors: dict[str, torch.Tensor], lm_head_weight: torch.Tensor | None, source: str
) -> dict[str, torch.Tensor]:
    """dflashkit's tensors → the serving layout's (see the module docstring); `lm_head_weight` (V, H) is the
    target's head, needed only for a reduced vocabulary."""
    out = {k: v for k, v in tensors.items() if k != "draft_to_target"}
    if cfg.draft_vocab_size is None:
        return out
    absolute = tensors["draft_to_target"].long()  # (draft_vocab,)
    if lm_head_weight is None:
        raise CheckpointError(
            f"{source}: a reduced draft vocabulary ({cfg.draft_vocab_size} tokens) is served with the target's "
            f"LM-head rows of those tokens: pass --target (the HF target directory) to export it"
        )
    if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(
            f"{source}: the target's LM head is {list(lm_head_weight.shape)}, expected "
            f"[{cfg.vocab_size}, {cfg.hidden_size}] (vocab_size × hidden_size of this drafter): another target?"
        )
    out["d2t"] = absolute - torch.arange(absolute.shape[0], dtype=torch.long)  # offsets: target = draft + d2t
    out["lm_head.weight"] = lm_head_weight.detach().cpu().index_select(0, absolute).contiguous()  # (draft_vocab, H)
    return out


def write_mask_file(out: Path, cfg: DrafterConfig, tensors: dict[str, torch.Tensor]) -> None:
    """`mask_embedding.pt` ({mask_token_id, embedding}): where vLLM reads a learned mask embedding from."""
    with atomic_path(out / MASK_FILE) as tmp:
        torch.save({"mask_token_id": cfg.mask_token_id, "embedding": tensors["mask_embedding"].clone()}, tmp)


def write_serving(
    out: Path, cfg: DrafterConfig, tensors: dict[str, torch.Tensor], lm_head_weight: torch.Tensor | None, source: str
) -> list[str]:
    """Write the serving layout into `out`; returns notes on what was translated."""
    from safetensors.torch import save_file

    problems = vllm_model_problems(cfg)
    if problems:
        raise CheckpointError(f"{source}: vLLM cannot run this drafter: " + "; ".join(problems))
    notes: list[str] = []
    if mixed_layers(cfg):
        notes.append(
            "the drafter mixes sliding and full attention layers: vLLM's GPU runner (V2) loads it, its CPU runner "
            "(V1) refuses it"
        )
    st = serving_tensors(cfg, tensors, lm_head_weight, source)
    if cfg.draft_vocab_size is not None:
        notes.append(
            f"reduced vocabulary: top-level draft_vocab_size {cfg.draft_vocab_size}, d2t offsets and lm_head.weight "
            f"(the target's rows of the {cfg.draft_vocab_size} draft ids), as vLLM loads them"
        )
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(st, str(tmp), metadata={"format": "pt"})
    atomic_write_text(out / CONFIG_NAME, json.dumps(serving_config(cfg), indent=2, sort_keys=True) + "\n")
    mask_file = out / MASK_FILE
    note = head_of(cfg).format.serving_note(cfg)
    notes += [note] if note else []
    if cfg.learned_mask_embedding:
        write_mask_file(out, cfg, tensors)
        notes.append(
            f"learned mask embedding written to {MASK_FILE} (vLLM reads it from there only); vLLM feeds it wherever "
            f"token {cfg.mask_token_id} is a drafter input"
        )
    elif mask_file.exists():
        mask_file.unlink()  # a stale override from an earlier export would change what vLLM runs
    return notes


def safe_learned_mask_id(cfg: DrafterConfig, target: Any, *, engine: str = "vLLM") -> tuple[DrafterConfig, str | None]:
    """For a learned mask, the mask_token_id `engine` substitutes at (vLLM's mask file, DeepSpec's embedding row): a
    row no chat produces (a spare embedding row, else an unused special token) when the target has one; else the id
    unchanged, with a warning."""
    if not cfg.learned_mask_embedding or target is None:
        return cfg, None
    from dflashkit.drafter.mask_choice import unused_special_token

    pick = target.spare_mask_token_id()
    if pick is None and getattr(target, "tokenizer", None) is not None:
        found = unused_special_token(target.tokenizer)
        pick = found[0] if found else None
    if pick is None:
        return cfg, (
            f"learned mask: {engine} substitutes it wherever token {cfg.mask_token_id} is a drafter input (the "
            f"block's first token too); this target has no token that no chat produces, so a block starting "
            f"with token {cfg.mask_token_id} drafts differently in {engine}"
        )
    if pick == cfg.mask_token_id:
        return cfg, None
    return cfg.replace(mask_token_id=int(pick)), (
        f"learned mask: mask_token_id {cfg.mask_token_id} → {pick} (a token no chat produces), so {engine}'s "
        f"substitution never hits a real token; dflashkit ignores the id for a learned mask"
    )


__all__ = [
    "SERVING_FORMAT",
    "mixed_layers",
    "safe_learned_mask_id",
    "serving_config",
    "serving_tensors",
    "vllm_model_problems",
    "write_mask_file",
    "write_serving",
]
