"""Checkpoint converters: speculators-format DFlash drafters ↔ z-lab format (what vLLM and SGLang load).

    dflashkit convert SRC OUT                      # speculators or z-lab → z-lab (vLLM method=dflash, SGLang DFLASH)
    dflashkit convert SRC OUT --dtype bf16         # … with floating tensors cast to bf16
    dflashkit convert SRC OUT --to speculators     # z-lab → speculators layout (round trips exactly)
    dflashkit convert SRC OUT --to vllm --target T # the serving layout vLLM loads as it is (export/serving.py)
    dflashkit convert SRC OUT.gguf --to gguf --target T.gguf   # llama.cpp dflash GGUF (dflashkit/export/gguf_export.py)

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
  LM-head rows from the target, so those tables are dropped, each with a note.
- vLLM's DFlash loader also accepts renamed keys (`midlayer.` → `layers.0.`, `encoder.fc.` → `fc.`,
  `encoder.output_norm_enc.` → `hidden_norm.`; `DFlashQwen3Model.hf_to_vllm_mapper` in qwen3_dflash.py).
A learned mask embedding is stored as the `mask_embedding` tensor and, for vLLM, also as `mask_embedding.pt`
(vLLM's qwen3_dflash.py `_read_mask_embedding` reads the override from that file).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dflashkit.drafter.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    check_finite,
    check_mask_file,
    check_tensors,
    drafter_state_dict,
    from_serving_layout,
    read_tensors,
)
from dflashkit.drafter.config import SLIDING_ATTENTION, DrafterConfig
from dflashkit.drafter.config_fields import check_zlab_field_types, field_value_ok
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.export.serving import (
    SERVING_FORMAT,
    safe_learned_mask_id,
    vllm_model_problems,
    write_mask_file,
    write_serving,
)
from dflashkit.io_utils import atomic_path, atomic_write_text

FORMATS = ("zlab", "speculators", SERVING_FORMAT)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}

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


@dataclass
class ConversionReport:
    """What a conversion did: source format, output, and one note per translated or dropped item."""

    source: str
    source_format: str
    out: str
    out_format: str
    notes: list[str] = field(default_factory=list)

    def render(self) -> str:
        head = f"converted {self.source} ({self.source_format}) → {self.out} ({self.out_format})"
        return "\n".join([head] + [f"  note: {n}" for n in self.notes])


def detect_format(raw: dict[str, Any]) -> str:
    """'speculators' for a speculators DFlash config, 'zlab' for a z-lab/dflashkit one, else 'unknown'."""
    if not isinstance(raw, dict):
        return "unknown"
    if "speculators_model_type" in raw or SPECULATORS_NESTED in raw or SPECULATORS_LAYER_IDS in raw:
        return "speculators"
    if "dflash_config" in raw or {"DFlashDraftModel", "Qwen3DSparkModel"} & set(raw.get("architectures") or []):
        return "zlab"
    return "unknown"


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    cfg = path / CONFIG_NAME
    if not cfg.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME} (expected a drafter checkpoint directory)")
    try:
        return json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{cfg}: not valid UTF-8 (byte offset {e.start}); expected a JSON config") from None


# ---------------------------------------------------------------------------------------------- config
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
    if kind != "dflash":
        raise refuse(f"speculators_model_type {kind!r} is not a DFlash drafter (expected 'dflash')")
    if raw.get("projector_type", "dflash") != "dflash":
        raise refuse(
            f"projector_type {raw['projector_type']!r} adds a correction head dflashkit cannot run; "
            f"only 'dflash' converts"
        )
    if raw.get("shift_label"):
        raise refuse(
            "shift_label: true — this drafter was trained to predict the token one position later than "
            "DFlash's slot k → token a+k; it would draft shifted tokens (design lesson 6)"
        )
    if raw.get("sample_from_anchor"):
        raise refuse("sample_from_anchor: true — slot 0 predicts a token (DSpark layout); z-lab DFlash discards slot 0")
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
        check_zlab_field_types({k: v for k, v in raw.items() if k != "dflash_config" and v is not None}, source)
        check_zlab_field_types(tl, f"{source} ({SPECULATORS_NESTED})")
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
    values = {f: tl[f] for f in TRANSFORMER_FIELDS if f in tl and tl[f] is not None}
    if not tl.get("layer_types"):
        values.pop("layer_types", None)
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
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise refuse(f"cannot build a drafter config ({e})") from None


def config_to_speculators(cfg: DrafterConfig) -> dict[str, Any]:
    """A speculators-style DFlash config.json for `cfg` (plus a `dflashkit` block so the round trip is exact)."""
    tl = {
        "model_type": "qwen3",
        **{f: getattr(cfg, f) for f in TRANSFORMER_FIELDS},
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
    }
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        SPECULATORS_NESTED: tl,
        "draft_vocab_size": cfg.draft_vocab_size or cfg.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        SPECULATORS_LAYER_IDS: [i + 1 for i in cfg.target_layer_ids],
        "mask_token_id": cfg.mask_token_id,
        "sliding_window_non_causal": cfg.is_causal is False and SLIDING_ATTENTION in cfg.layer_types,
        "projector_type": "dflash",
        "shift_label": False,
        "sample_from_anchor": False,
        "num_target_layers": cfg.num_target_layers,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size - 1}],
            "verifier": {
                "name_or_path": None,
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


def tensors_to_speculators(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in tensors.items() if k != "draft_to_target"}
    if "draft_to_target" in tensors:
        absolute = tensors["draft_to_target"].long()
        out["d2t"] = absolute - torch.arange(absolute.shape[0], dtype=torch.long)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[absolute] = True
        out["t2d"] = t2d
    return out


# ---------------------------------------------------------------------------------------------- entry points
def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous() for k, v in tensors.items()
    }


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_any(
    path: str | Path, *, num_target_layers: int | None = None, notes: list[str] | None = None
) -> tuple[DrafterConfig, dict[str, torch.Tensor], str]:
    """(config, dflashkit-named tensors, source format) of a z-lab or speculators checkpoint, checked strictly."""
    path = Path(path)
    notes = notes if notes is not None else []
    raw = _read_config(path)
    fmt = detect_format(raw)
    tensors = read_tensors(path)
    if fmt == "speculators":
        cfg = config_from_speculators(
            raw, num_target_layers=num_target_layers, notes=notes, source=str(path / CONFIG_NAME)
        )
        if "mask_embedding" in tensors and not cfg.learned_mask_embedding:
            cfg = cfg.replace(learned_mask_embedding=True)
        tensors = tensors_from_speculators(tensors, cfg, notes)
    else:
        try:
            cfg = DrafterConfig.from_zlab_dict(raw, source=str(path / CONFIG_NAME))
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        if num_target_layers is not None and num_target_layers != cfg.num_target_layers:
            notes.append(f"num_target_layers {cfg.num_target_layers} → {num_target_layers}")
            cfg = cfg.replace(num_target_layers=num_target_layers)
        tensors = from_serving_layout(tensors, str(path))  # a serving export (d2t offsets, LM-head rows)
        check_mask_file(path, tensors, cfg.mask_token_id)
    with torch.device("meta"):
        check_tensors(tensors, drafter_state_dict(DFlashDrafter(cfg)), cfg, str(path))
    check_finite(tensors, str(path))
    return cfg, tensors, fmt


def convert(
    src: str | Path,
    out: str | Path,
    *,
    to: str = "zlab",
    dtype: str | torch.dtype | None = None,
    num_target_layers: int | None = None,
    target: Any = None,
) -> ConversionReport:
    """Convert a z-lab, speculators or serving-layout checkpoint to `to` ('zlab', 'speculators' or 'vllm': the
    serving layout, export/serving.py; `target`, a loaded Target, gives a reduced vocabulary its LM-head rows);
    returns what was done."""
    if to not in FORMATS:
        raise ConfigError(f"unknown output format {to!r}; expected one of {', '.join(FORMATS)}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise ConfigError(f"output {out} is the source checkpoint; choose another directory")
    notes: list[str] = []
    cfg, tensors, fmt = load_any(src, num_target_layers=num_target_layers, notes=notes)
    tensors = _cast(tensors, dtype)
    if dtype is not None:
        notes.append(f"floating tensors cast to {str(dtype).replace('torch.', '')}")
    if to == SERVING_FORMAT:
        cfg, why = safe_learned_mask_id(cfg, target)
        notes += [why] if why else []
        head = target.lm_head_weight.float() if target is not None and cfg.draft_vocab_size is not None else None
        head = head.to(dtype) if head is not None and dtype is not None else head
        notes += write_serving(out, cfg, tensors, head, str(src))
        return ConversionReport(str(src), fmt, str(out), SERVING_FORMAT, notes)
    if to == "speculators":
        _write(out, tensors_to_speculators(tensors, cfg), config_to_speculators(cfg))
        if cfg.learned_mask_embedding:
            notes.append("mask_embedding kept as a tensor; speculators itself has no learned mask embedding")
        return ConversionReport(str(src), fmt, str(out), "speculators", notes)
    config = cfg.to_zlab_dict()
    if dtype is not None:
        config["torch_dtype"] = str(dtype).replace("torch.", "")
    if cfg.draft_vocab_size is not None:
        config["draft_vocab_size"] = cfg.draft_vocab_size  # vLLM reads the top-level field
        notes.append(
            "reduced vocabulary kept as draft_to_target (absolute ids), which vLLM refuses: convert --to vllm "
            "--target T writes the d2t offsets and LM-head rows it loads"
        )
    _write(out, tensors, config)
    if cfg.learned_mask_embedding:
        write_mask_file(out, cfg, tensors)
        notes.append(
            f"learned mask embedding also written to mask_embedding.pt for vLLM (it replaces the "
            f"embedding of token {cfg.mask_token_id} wherever that id appears; SGLang ignores it and "
            f"uses the target's row {cfg.mask_token_id})"
        )
    return ConversionReport(str(src), fmt, str(out), "zlab", notes)


def export_checkpoint(target: Any, chosen: str | Path, out_dir: Path) -> list[str]:
    """A trained checkpoint into `out_dir` in the serving layout (what the quickstart exports); a drafter vLLM
    cannot run (e.g. gelu, asked for explicitly) is copied in dflashkit's own layout instead, with the reason."""
    import shutil

    cfg, tensors, _ = load_any(chosen)
    problems = vllm_model_problems(cfg)
    if problems:
        shutil.copytree(chosen, out_dir)
        return [f"exported in dflashkit's layout: vLLM cannot run this drafter ({'; '.join(problems)})"]
    cfg, why = safe_learned_mask_id(cfg, target)
    notes = [why] if why else []
    return notes + write_serving(out_dir, cfg, tensors, target.lm_head_weight, str(chosen))


__all__ = [
    "DROPPED_KEYS",
    "KEY_SUBSTRINGS",
    "SPECULATORS_LAYER_IDS",
    "ConversionReport",
    "config_from_speculators",
    "config_to_speculators",
    "convert",
    "detect_format",
    "export_checkpoint",
    "load_any",
    "map_key",
    "tensors_from_speculators",
    "tensors_to_speculators",
]
