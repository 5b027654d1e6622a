"""Checkpoint converters: speculators-format and DeepSpec drafters ↔ z-lab format (what vLLM and SGLang load).

    dflashkit convert SRC OUT                      # speculators, DeepSpec or z-lab → z-lab (vLLM, SGLang DFLASH)
    dflashkit convert SRC OUT --target T           # … checking the target tables a DeepSpec checkpoint carries
    dflashkit convert SRC OUT --dtype bf16         # … with floating tensors cast to bf16
    dflashkit convert SRC OUT --to speculators     # z-lab → speculators layout (round trips exactly; a reduced
                                                   #   vocabulary needs --target T for its LM-head rows)
    dflashkit convert SRC OUT --to deepspec --target T   # a DSpark drafter as DeepSpec loads it (export/deepspec.py)
    dflashkit convert SRC OUT --to vllm --target T # the serving layout vLLM loads as it is (export/serving.py)
    dflashkit convert SRC OUT.gguf --to gguf --target T.gguf   # llama.cpp dflash GGUF (dflashkit/export/gguf_export.py)

The speculators layout (field names, layer-id shift, dropped tables) is translated in
`dflashkit/export/speculators_format.py`.
A DeepSpec DSpark checkpoint (`Qwen3DSparkModel`: the layout dflashkit writes, plus frozen full-vocabulary copies
of the target's `embed_tokens` and `lm_head`) loads as dflashkit's own once those copies are dropped; with `--target`
they are first compared with the target's tables (export/deepspec.py).
A learned mask embedding is stored as the `mask_embedding` tensor and, for vLLM, also as `mask_embedding.pt`
(vLLM's qwen3_dflash.py `_read_mask_embedding` reads the override from that file).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
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
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.export.deepspec import (
    DEEPSPEC_FORMAT,
    deepspec_config,
    deepspec_problems,
    deepspec_tensors,
    import_tables,
)
from dflashkit.export.model_card import Measured, ModelCard, drafter_fingerprints, measured_in, write_model_card
from dflashkit.export.serving import (
    SERVING_FORMAT,
    safe_learned_mask_id,
    vllm_model_problems,
    write_mask_file,
    write_serving,
)
from dflashkit.export.speculators_format import (
    DROPPED_KEYS,
    KEY_SUBSTRINGS,
    SPECULATORS_LAYER_IDS,
    SPECULATORS_NESTED,
    config_from_speculators,
    config_to_speculators,
    map_key,
    speculators_differences,
    tensors_from_speculators,
    tensors_to_speculators,
)
from dflashkit.io_utils import atomic_path, atomic_write_text
from dflashkit.target.model import check_drafter_fits

FORMATS = ("zlab", "speculators", SERVING_FORMAT, DEEPSPEC_FORMAT)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
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


def read_config(path: Path) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------- entry points
def check_output(out: Path, *, overwrite: bool) -> None:
    """Refuse an output that would replace what is there: a non-empty directory, or (a file export) an existing
    file — unless `overwrite`. A file where a directory is expected is refused either way."""
    if not out.exists():
        return
    if out.suffix == ".gguf":
        if not out.is_file():
            raise ConfigError(f"output {out} exists and is not a file; expected a new .gguf file name")
        if not overwrite:
            raise ConfigError(f"output {out} exists; choose a new file name, or pass --overwrite to replace it")
        return
    if not out.is_dir():
        raise ConfigError(f"output {out} is a file; expected a directory (new or empty)")
    present = sorted(p.name for p in out.iterdir())
    if present and not overwrite:
        shown = ", ".join(present[:4]) + (f", … ({len(present)} entries)" if len(present) > 4 else "")
        raise ConfigError(
            f"output {out} is not empty ({shown}); convert writes config.json and model.safetensors there — "
            "choose a new or empty directory, or pass --overwrite to replace them"
        )


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
    path: str | Path, *, num_target_layers: int | None = None, notes: list[str] | None = None, target: Any = None
) -> tuple[DrafterConfig, dict[str, torch.Tensor], str]:
    """(config, dflashkit-named tensors, source format) of a z-lab, DeepSpec or speculators checkpoint, checked
    strictly; `target` (a loaded Target) checks the target tables a DeepSpec checkpoint carries."""
    path = Path(path)
    notes = notes if notes is not None else []
    raw = read_config(path)
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
        before = len(tensors)
        tensors = import_tables(tensors, cfg, target, notes, str(path))  # DeepSpec's copies of the target's tables
        fmt = DEEPSPEC_FORMAT if len(tensors) < before else fmt
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
    overwrite: bool = False,
    evals: Sequence[str | Path] = (),
) -> ConversionReport:
    """Convert a z-lab, speculators or serving-layout checkpoint to `to` ('zlab', 'speculators' or 'vllm': the
    serving layout, export/serving.py; `target`, a loaded Target, gives a reduced vocabulary its LM-head rows);
    returns what was done. `out` must be new or empty unless `overwrite` (a typo must not replace a model's own
    config.json and weights). A model card goes beside the weights (export/model_card.py), with the τ of this drafter
    in the `eval` output directories `evals`."""
    if to not in FORMATS:
        raise ConfigError(f"unknown output format {to!r}; expected one of {', '.join(FORMATS)}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise ConfigError(f"output {out} is the source checkpoint; choose another directory")
    check_output(out, overwrite=overwrite)
    notes: list[str] = []
    if num_target_layers is None and target is not None and _records_no_depth(src):
        num_target_layers = target.num_layers  # a speculators config does not say how deep its target is
    cfg, tensors, fmt = load_any(src, num_target_layers=num_target_layers, notes=notes, target=target)
    if target is not None:  # an export names its target: it must be the drafter's (sizes, vocabulary, layers)
        check_drafter_fits(cfg, target, source=str(src))
    cast = _cast(tensors, dtype)
    measured = _measured(evals, [cfg, safe_learned_mask_id(cfg, target)[0]], [tensors, cast])  # before writing
    if dtype is not None:
        notes.append(f"floating tensors cast to {str(dtype).replace('torch.', '')}")
    written = _write_format(to, src, out, cfg, cast, target=target, dtype=dtype, notes=notes)
    name = getattr(target, "source", None) if target is not None else None
    notes.append(write_model_card(ModelCard(out, to, written, src, target=name, evals=measured)))
    return ConversionReport(str(src), fmt, str(out), to, notes)


def _measured(evals: Sequence[str | Path], cfgs: list[DrafterConfig], tensor_sets: list[Any]) -> list[Measured]:
    """The evaluations of this drafter (as read, or with its export's mask id / cast) in `evals`."""
    return measured_in(evals, drafter_fingerprints(cfgs, tensor_sets)) if evals else []


def _write_format(
    to: str,
    src: Path,
    out: Path,
    cfg: DrafterConfig,
    tensors: dict[str, torch.Tensor],
    *,
    target: Any,
    dtype: torch.dtype | None,
    notes: list[str],
) -> DrafterConfig:
    """Write `out` in layout `to`; returns the drafter config as written (a learned mask's id may move)."""
    if to == SERVING_FORMAT:
        cfg, why = safe_learned_mask_id(cfg, target)
        notes += [why] if why else []
        notes += write_serving(out, cfg, tensors, _reduced_head_source(cfg, target, dtype), str(src))
        return cfg
    if to == DEEPSPEC_FORMAT:
        problems = deepspec_problems(cfg)
        if problems:
            raise CheckpointError(f"{src}: cannot be written in DeepSpec's layout exactly: " + "; ".join(problems))
        cfg, why = safe_learned_mask_id(cfg, target, engine="DeepSpec")
        notes += [why] if why else []
        _write(out, deepspec_tensors(cfg, tensors, target), deepspec_config(cfg))
        notes.append("the target's embeddings and LM head written with the drafter (DeepSpec loads them from here)")
        return cfg
    if to == "speculators":
        tensors, why = tensors_to_speculators(tensors, cfg, _reduced_head_source(cfg, target, dtype), str(src))
        source = getattr(target, "source", "") if target is not None else ""
        verifier = str(Path(source).resolve()) if source and Path(source).is_dir() else None
        _write(out, tensors, config_to_speculators(cfg, verifier))
        notes += why + speculators_differences(cfg)
        if verifier is None:
            notes.append(
                "speculators_config.verifier.name_or_path left empty: speculators' loader takes the embeddings from "
                "there — pass --target (an HF directory) or set it to the target's id before loading in speculators"
            )
        return cfg
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
    return cfg


def _records_no_depth(src: Path) -> bool:
    """Whether the checkpoint's config leaves its target's depth unsaid (speculators' layout)."""
    raw = read_config(src)
    return detect_format(raw) == "speculators" and raw.get("num_target_layers") is None


def load_any_drafter(path: str | Path, *, target: Any = None, device: str | torch.device = "cpu") -> DFlashDrafter:
    """A drafter directory ready to run: dflashkit's, z-lab's or the serving layout strictly (`load_drafter`), a
    speculators checkpoint as `convert` reads it (its config does not record the target's depth: taken from
    `target`, a loaded Target)."""
    from dflashkit.drafter.checkpoint import load_drafter

    if detect_format(read_config(Path(path))) != "speculators":
        return load_drafter(path, device=device)
    depth = target.num_layers if target is not None else None
    cfg, tensors, _ = load_any(path, num_target_layers=depth)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True)
    return drafter.to(device)


def _reduced_head_source(cfg: DrafterConfig, target: Any, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The target's LM head (V, H) a reduced vocabulary's exported rows are cut from (None: not needed or no
    target; the writer then names --target)."""
    if target is None or cfg.draft_vocab_size is None:
        return None
    head = target.lm_head_weight.float()
    return head.to(dtype) if dtype is not None else head


def export_checkpoint(target: Any, chosen: str | Path, out_dir: Path) -> list[str]:
    """A trained checkpoint into `out_dir` in the serving layout (what the quickstart exports); a drafter vLLM
    cannot run (e.g. gelu, asked for explicitly) is copied in dflashkit's own layout instead, with the reason. A model
    card goes with it."""
    import shutil

    cfg, tensors, _ = load_any(chosen)
    problems = vllm_model_problems(cfg)
    if problems:
        shutil.copytree(chosen, out_dir)
        notes = [f"exported in dflashkit's layout: vLLM cannot run this drafter ({'; '.join(problems)})"]
        layout = "zlab"
    else:
        cfg, why = safe_learned_mask_id(cfg, target)
        notes = ([why] if why else []) + write_serving(out_dir, cfg, tensors, target.lm_head_weight, str(chosen))
        layout = SERVING_FORMAT
    return [*notes, write_model_card(ModelCard(Path(out_dir), layout, cfg, Path(chosen), target=target.source))]


__all__ = [
    "DROPPED_KEYS",
    "KEY_SUBSTRINGS",
    "SPECULATORS_LAYER_IDS",
    "ConversionReport",
    "check_output",
    "config_from_speculators",
    "config_to_speculators",
    "convert",
    "detect_format",
    "export_checkpoint",
    "load_any",
    "load_any_drafter",
    "map_key",
    "tensors_from_speculators",
    "tensors_to_speculators",
]
