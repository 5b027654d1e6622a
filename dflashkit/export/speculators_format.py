"""The speculators checkpoint layout (vllm-project/speculators) ↔ dflashkit's DrafterConfig and tensor names, for
DFlash and DSpark drafters.

What differs between the two formats (vllm-project/speculators `src/speculators/models/dflash/{config,core}.py`,
`src/speculators/model.py`, `src/speculators/data_generation/vocab_mapping.py`; vLLM's
`vllm/transformers_utils/configs/speculators/algos.py::update_dflash`):
- layer ids: speculators' `aux_hidden_state_layer_ids` index `hidden_states` (0 = embedding output, so id i is
  the output of decoder layer i − 1); z-lab's `dflash_config.target_layer_ids` are decoder-layer indices.
  vLLM's update_dflash maps them exactly so: `target_layer_ids = [i - 1 for i in aux_hidden_state_layer_ids]`.
- the transformer geometry sits in a nested `transformer_layer_config`; `block_size`, `mask_token_id`,
  `draft_vocab_size`, `target_hidden_size` are top-level fields.
- tensors: the same drafter keys (`fc`, `hidden_norm`, `layers.N…`, `norm`); speculators may also save
  `embed_tokens.weight` (older versions), `lm_head.weight` (reduced vocabularies: frozen rows of the verifier's
  head), `verifier_*` and the vocabulary maps `d2t` (an OFFSET: target id = draft id + d2t[draft id]) and `t2d`
  (bool over the target vocabulary). dflashkit keeps an absolute `draft_to_target` map and takes embeddings and
  LM-head rows from the target, so those tables are dropped on import, each with a note. On export a reduced
  vocabulary gets all three (`lm_head.weight` from the target: speculators' `DFlashDraftModel` loads a reduced head
  only from the checkpoint — vLLM 0.32 rebuilds a missing one, measured with serve-check), its draft ids in
  ascending target-id order as speculators assumes.
- vLLM's DFlash loader also accepts renamed keys (`midlayer.` → `layers.0.`, `encoder.fc.` → `fc.`,
  `encoder.output_norm_enc.` → `hidden_norm.`; `DFlashQwen3Model.hf_to_vllm_mapper` in qwen3_dflash.py).
- DSpark (`speculators_model_type: dspark`, `src/speculators/models/dspark/{config,core,model_definitions}.py`): the
  same backbone fields plus top-level `markov_rank`, `markov_head_type`, `enable_confidence_head`,
  `confidence_head_with_markov` and `sample_from_anchor` (true: every slot drafts, slot k → token a + k + 1), and the
  tensors `markov_head.markov_w1.weight` (verifier vocabulary × r), `markov_head.markov_w2.weight` (draft vocabulary
  × r) and `confidence_head.proj.{weight,bias}` — the names dflashkit and DeepSpec use. Only what dflashkit runs
  converts (a vanilla Markov head, every slot drafting, a confidence head reading [hidden; W1[previous token]]);
  the loss weights (`ce_loss_alpha`, …) are training settings: not read, and not written (speculators' defaults).
"""

from __future__ import annotations

from typing import Any

import torch

from dflashkit.drafter.checkpoint import CONFIG_NAME, drafter_state_dict
from dflashkit.drafter.config import SLIDING_ATTENTION, DrafterConfig, check_declared_values, integral_ints
from dflashkit.drafter.config_fields import check_zlab_field_types, field_value_ok
from dflashkit.drafter.heads import KINDS, head_of
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.export.serving import serving_tensors

# speculators DFlashSpeculatorConfig field ← → DrafterConfig field (top level of the speculators config.json).
SPECULATORS_TOP_FIELDS = {
    "block_size": "block_size",
    "mask_token_id": "mask_token_id",
    "draft_vocab_size": "draft_vocab_size",
}
SPECULATORS_LAYER_IDS = "aux_hidden_state_layer_ids"  # hidden_states indices: z-lab id = i − 1
SPECULATORS_NESTED = "transformer_layer_config"  # Qwen3Config.to_diff_dict() of the draft layers
# DrafterConfig fields read from transformer_layer_config (same names there).
TRANSFORMER_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "layer_types",
    "sliding_window",
)
# Key renames applied before matching (prefix strip, then substrings), as vLLM's DFlash weight mapper does.
KEY_PREFIXES = ("model.",)
KEY_SUBSTRINGS = (("midlayer.", "layers.0."), ("encoder.output_norm_enc.", "hidden_norm."), ("encoder.fc.", "fc."))
# Tables a speculators checkpoint may carry that a dflashkit drafter takes from the target instead.
DROPPED_KEYS = {
    "embed_tokens.weight": "the target's input embeddings (the drafter uses the target's own table)",
    "lm_head.weight": "LM-head rows (the drafter uses the target's LM head, through draft_to_target if reduced)",
    "verifier_lm_head.weight": "the verifier's LM head (frozen copy used in speculators training)",
    "verifier_norm.weight": "the verifier's final norm (frozen copy used in speculators training)",
    "t2d": "the target→draft vocabulary mask (implied by d2t)",
}


# ---------------------------------------------------------------------------------------------- config
def _foreign_training(raw: dict[str, Any], kind: str) -> str | None:
    """Why a speculators config describes a drafter trained otherwise than dflashkit runs it (None: it does not)."""
    if raw.get("projector_type", "dflash") != "dflash":
        kind_of = raw["projector_type"]
        return f"projector_type {kind_of!r} adds a correction head dflashkit cannot run; only 'dflash' converts"
    if raw.get("shift_label"):
        return (
            "shift_label: true — this drafter was trained to predict the token one position later than "
            "DFlash's slot k → token a+k; it would draft shifted tokens (docs/troubleshooting.md#pitfall-label-shift)"
        )
    if head_of(kind).first_draft_slot == 1 and raw.get("sample_from_anchor"):
        return "sample_from_anchor: true — slot 0 predicts a token (DSpark layout); z-lab DFlash discards slot 0"
    return None


def config_from_speculators(
    raw: dict[str, Any],
    *,
    num_target_layers: int | None = None,
    notes: list[str] | None = None,
    source: str = CONFIG_NAME,
) -> DrafterConfig:
    """Translate a speculators DFlash config.json into a DrafterConfig (raises CheckpointError when impossible)."""
    notes = notes if notes is not None else []

    def refuse(msg: str) -> CheckpointError:
        return CheckpointError(f"{source}: {msg}")

    kind = raw.get("speculators_model_type", "dflash")
    if kind not in KINDS:
        raise refuse(f"speculators_model_type {kind!r} is not a drafter kind dflashkit runs (expected one of {KINDS})")
    try:
        check_zlab_field_types({k: v for k, v in raw.items() if k != "dflash_config" and v is not None}, source)
        # each value against its declared DrafterConfig type before any arithmetic (a head count of 0 must not
        # reach hidden // heads): the door z-lab configs pass too
        check_declared_values({k: v for k, v in raw.items() if k != SPECULATORS_NESTED}, {}, source)
        head_fields = head_of(kind).format.fields_from_speculators(raw, source)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    why = _foreign_training(raw, kind)
    if why:
        raise refuse(why)
    tl = raw.get(SPECULATORS_NESTED)
    if not isinstance(tl, dict):
        raise refuse(f"required field '{SPECULATORS_NESTED}' is missing (expected the draft layers' Qwen3 config)")
    missing = [
        f
        for f in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        if f not in tl
    ]
    if missing:
        raise refuse(f"{SPECULATORS_NESTED} lacks required field(s) {missing}")
    try:
        check_zlab_field_types(tl, f"{source} ({SPECULATORS_NESTED})")
        check_declared_values(tl, {}, f"{source} ({SPECULATORS_NESTED})")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    aux_raw = raw.get(SPECULATORS_LAYER_IDS)
    if aux_raw is not None and not field_value_ok("target_layer_ids", aux_raw):
        raise refuse(f"field '{SPECULATORS_LAYER_IDS}' must be a list of integers, got {aux_raw!r}")
    hidden = int(tl["hidden_size"])
    if raw.get("target_hidden_size") not in (None, hidden):
        raise refuse(
            f"target_hidden_size {raw['target_hidden_size']} ≠ the drafter's hidden_size {hidden}: "
            f"dflashkit drafters read features of their own width"
        )
    aux = raw.get(SPECULATORS_LAYER_IDS) or raw.get("target_layer_ids")
    if not aux:
        raise refuse(f"required field '{SPECULATORS_LAYER_IDS}' is missing or empty")
    ids = [int(i) - 1 for i in aux]
    if min(ids) < 0:
        raise refuse(
            f"{SPECULATORS_LAYER_IDS} {list(aux)} contains 0 (the embedding output), which no z-lab "
            f"target_layer_id can express"
        )
    notes.append(
        f"layer ids: speculators {SPECULATORS_LAYER_IDS} {list(aux)} (hidden_states indices) → z-lab "
        f"target_layer_ids {ids} (decoder-layer indices, i − 1)"
    )
    if raw.get("mask_token_id") is None:
        raise refuse("mask_token_id is not set (speculators leaves it None unless --mask-token-id was given)")
    ours = raw.get("dflashkit") if isinstance(raw.get("dflashkit"), dict) else {}
    if num_target_layers is None:
        num_target_layers = raw.get("num_target_layers")
    if num_target_layers is None:
        num_target_layers = max(ids) + 4
        notes.append(
            f"num_target_layers is not recorded in a speculators config; assumed {num_target_layers} "
            f"(z-lab's default max(id) + 4) — pass --num-target-layers to set the target's real depth"
        )
    vocab = int(tl["vocab_size"])
    draft_vocab = raw.get("draft_vocab_size")
    draft_vocab = None if draft_vocab in (None, vocab) else int(draft_vocab)
    rope = tl.get("rope_parameters") or {}
    theta = rope.get("rope_theta", tl.get("rope_theta", 1_000_000.0))
    is_causal = (
        ours.get("is_causal") if "is_causal" in ours else (False if raw.get("sliding_window_non_causal") else None)
    )
    values = integral_ints(
        {f: tl[f] for f in TRANSFORMER_FIELDS if tl.get(f) is not None and (f != "layer_types" or tl[f])}
    )
    notes += _sliding_window_notes(tl)
    if "head_dim" not in values:
        values["head_dim"] = hidden // int(tl["num_attention_heads"])
    try:
        return DrafterConfig(
            **values,
            num_target_layers=int(num_target_layers),
            target_layer_ids=ids,
            block_size=int(raw.get("block_size", 8)),
            mask_token_id=int(raw["mask_token_id"]),
            learned_mask_embedding=bool(ours.get("learned_mask_embedding", False)),
            is_causal=is_causal,
            rope_theta=float(theta),
            draft_vocab_size=draft_vocab,
            extra=dict(ours.get("extra") or {}),
            kind=kind,
            **integral_ints(head_fields),
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise refuse(f"cannot build a drafter config ({e})") from None


def _sliding_window_notes(tl: dict[str, Any]) -> list[str]:
    """How speculators ran sliding-window draft layers, where that differs from how dflashkit (and z-lab, vLLM) run
    them. Read from speculators 0.9.0 (`models/dflash/attention.py`, transformers' Qwen3Config)."""
    if SLIDING_ATTENTION not in (tl.get("layer_types") or []):
        return []
    window = tl.get("sliding_window")
    if tl.get("use_sliding_window") is not True:
        return [
            f"{SPECULATORS_NESTED}.use_sliding_window is not true: speculators' Qwen3Config dropped sliding_window "
            f"{window}, so its sliding layers attended to the whole context; dflashkit applies the window as written"
        ]
    return [_anchor_window_note(window)]


def _anchor_window_note(window: Any) -> str:
    return (
        f"sliding-window layers: speculators' training counts the {window}-token window from the block's anchor "
        f"(every slot sees the same context); dflashkit, z-lab and vLLM count it from each slot's own position (slot "
        f"k sees k + 1 fewer of the oldest positions) — contexts longer than the window draft slightly differently"
    )


def speculators_differences(cfg: DrafterConfig) -> list[str]:
    """What speculators' own model (`DFlashDraftModel` / `DSparkDraftModel`) would run differently from `cfg`: the
    exported layout still round-trips exactly, but drafts made by speculators from it differ."""
    out = []
    if cfg.learned_mask_embedding:
        out.append(
            f"mask_embedding kept as a tensor for dflashkit only: speculators' model embeds the target's row "
            f"{cfg.mask_token_id} in the mask slots instead, so its drafts differ (vLLM reads a learned mask only "
            f"from mask_embedding.pt: use --to vllm --target T)"
        )
    if cfg.is_causal is True and any(t != SLIDING_ATTENTION for t in cfg.layer_types):
        out.append(
            "is_causal true: speculators' model attends bidirectionally within the block in full-attention "
            "layers (it has no causal switch for them), so its drafts differ"
        )
    if SLIDING_ATTENTION in cfg.layer_types:
        out.append(_anchor_window_note(cfg.sliding_window))
    return out


def config_to_speculators(cfg: DrafterConfig, verifier: str | None = None) -> dict[str, Any]:
    """A speculators-style DFlash or DSpark config.json for `cfg` (plus a `dflashkit` block so the round trip is
    exact). `verifier`: the target's HF directory or id, where speculators' loader takes the embeddings (and the LM
    head of a full vocabulary) from — without it speculators' model keeps them uninitialised."""
    head = head_of(cfg)
    tl = {
        "model_type": "qwen3",
        **{f: getattr(cfg, f) for f in TRANSFORMER_FIELDS},
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        # Qwen3Config drops sliding_window unless use_sliding_window is true: the sliding layers would see everything
        "use_sliding_window": SLIDING_ATTENTION in cfg.layer_types,
    }
    return {
        "architectures": [head.format.speculators_architecture],
        "speculators_model_type": cfg.kind,
        **head.format.speculators_fields(cfg),
        SPECULATORS_NESTED: tl,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        SPECULATORS_LAYER_IDS: [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": cfg.is_causal is False and SLIDING_ATTENTION in cfg.layer_types,
        "projector_type": "dflash",
        "shift_label": False,
        "sample_from_anchor": head.first_draft_slot == 0,  # every slot drafts (DSpark)
        "num_target_layers": cfg.num_target_layers,
        "speculators_config": {
            "algorithm": cfg.kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": head.drafts_per_round(cfg.block_size)}
            ],
            "verifier": {
                "name_or_path": verifier,
                "architectures": [cfg.extra.get("target_architecture")] if cfg.extra.get("target_architecture") else [],
            },
        },
        "dflashkit": {
            "extra": cfg.extra,
            "learned_mask_embedding": cfg.learned_mask_embedding,
            "is_causal": cfg.is_causal,
        },
    }


# ---------------------------------------------------------------------------------------------- tensors
def map_key(name: str) -> str:
    """A speculators / vLLM-variant tensor name → dflashkit's name."""
    for prefix in KEY_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
    for old, new in KEY_SUBSTRINGS:
        name = name.replace(old, new)
    return name


def tensors_from_speculators(
    tensors: dict[str, torch.Tensor], cfg: DrafterConfig, notes: list[str]
) -> dict[str, torch.Tensor]:
    """Rename, drop the target's tables with a note each, and turn the `d2t` offsets into `draft_to_target`."""
    out: dict[str, torch.Tensor] = {}
    d2t = t2d = None
    with torch.device("meta"):
        own = set(drafter_state_dict(DFlashDrafter(cfg.replace(learned_mask_embedding=True))))
    for name, tensor in tensors.items():
        key = map_key(name)
        if key != name:
            notes.append(f"renamed {name} → {key}")
        if key == "d2t":
            d2t = tensor
        elif key == "t2d":
            t2d = tensor
            notes.append(f"dropped t2d: {DROPPED_KEYS['t2d']}")
        elif key in own:
            out[key] = tensor
        elif key in DROPPED_KEYS or "embed" in key or "lm_head" in key:
            why = DROPPED_KEYS.get(key, "an embedding / LM-head table")
            notes.append(f"dropped {name} {list(tensor.shape)}: {why}")
        else:
            raise CheckpointError(
                f"unexpected tensor '{name}' {list(tensor.shape)} in the speculators checkpoint: "
                f"not part of a DFlash drafter (a DSpark/Domino head?)"
            )
    if cfg.draft_vocab_size is not None:
        if d2t is None:
            raise CheckpointError(f"draft_vocab_size {cfg.draft_vocab_size} but no d2t tensor (draft → target map)")
        absolute = torch.arange(d2t.shape[0], dtype=torch.long) + d2t.long()  # target id = draft id + d2t[draft id]
        if t2d is not None and not torch.equal(torch.nonzero(t2d.bool()).flatten(), absolute.sort().values):
            raise CheckpointError("d2t and t2d disagree: the target ids d2t maps to are not the ones t2d marks")
        out["draft_to_target"] = absolute
        notes.append(f"d2t offsets → draft_to_target (absolute target ids, {d2t.shape[0]} entries)")
    elif d2t is not None:
        notes.append("dropped d2t: draft vocabulary equals the target's")
    return out


# Tensors whose rows are draft ids (a reduced vocabulary's order): reordered with the draft ids.
DRAFT_ROW_TENSORS = ("markov_head.markov_w2.weight",)


def ascending_draft_ids(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str | None]:
    """Put a reduced vocabulary's draft ids in ascending target-id order, with the rows indexed by them.

    speculators builds the reduced LM head and its training targets by selecting the verifier's rows with the
    boolean `t2d` (so in target-id order), and SpecForge and speculators sort their draft vocabularies so. A
    drafter with draft ids in another order computes the same logits after the reorder, permuted with its ids."""
    absolute = tensors["draft_to_target"].long()  # (V',)
    order = torch.argsort(absolute)  # (V',)
    if torch.equal(order, torch.arange(order.shape[0])):
        return tensors, None
    out = dict(tensors)
    out["draft_to_target"] = absolute[order]
    for key in DRAFT_ROW_TENSORS:
        if key in out:
            out[key] = out[key].index_select(0, order).contiguous()
    return out, (
        "draft ids reordered by target id (speculators selects the verifier's LM-head rows with t2d, in id "
        "order): the same logits, with the draft ids permuted"
    )


def tensors_to_speculators(
    tensors: dict[str, torch.Tensor], cfg: DrafterConfig, lm_head_weight: torch.Tensor | None, source: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """dflashkit's tensors → speculators' (and notes). A reduced vocabulary also gets `d2t` offsets, the `t2d` mask
    and `lm_head.weight`, the target's rows of the draft ids (`lm_head_weight` (V, H) is the target's head):
    speculators' own model reads a reduced head from the checkpoint only, never from the verifier."""
    notes: list[str] = []
    if cfg.draft_vocab_size is not None:
        tensors, why = ascending_draft_ids(tensors)
        notes += [why] if why else []
    out = serving_tensors(cfg, tensors, lm_head_weight, source)  # + d2t offsets and lm_head rows when reduced
    if cfg.draft_vocab_size is not None:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)  # (V,)
        t2d[tensors["draft_to_target"].long()] = True
        out["t2d"] = t2d
    return out, notes


__all__ = [
    "DRAFT_ROW_TENSORS",
    "DROPPED_KEYS",
    "KEY_SUBSTRINGS",
    "SPECULATORS_LAYER_IDS",
    "SPECULATORS_NESTED",
    "ascending_draft_ids",
    "config_from_speculators",
    "config_to_speculators",
    "map_key",
    "speculators_differences",
    "tensors_from_speculators",
    "tensors_to_speculators",
]
