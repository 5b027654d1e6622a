"""Drafter checkpoints in z-lab format: a directory with `config.json` and `model.safetensors`.

Keys have no prefix and hold no embedding table or LM head: `fc.weight`, `hidden_norm.weight`,
`layers.N.{input_layernorm,post_attention_layernorm}.weight`, `layers.N.self_attn.{q,k,v,o}_proj.weight`,
`layers.N.self_attn.{q,k}_norm.weight`, `layers.N.mlp.{gate,up,down}_proj.weight`, `norm.weight` — plus
`mask_embedding` when the drafter learns its own mask vector and `draft_to_target` with a reduced draft vocabulary.
The serving layout (`dflashkit convert … --to vllm`, what vLLM loads) loads as well: its `d2t` offsets become
`draft_to_target` (target id = draft id + d2t), `t2d` and the `lm_head.weight` copy of the target's rows are left
out (the drafter reads the target's head), and a `mask_embedding.pt` must agree with the `mask_embedding` tensor.
Loading is strict: missing or unexpected keys are listed, wrong shapes name the key with expected vs found.
Writes are atomic (temp file + rename). Weights are read only through safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.io_utils import atomic_path
from dflashkit.shell import shell_line

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


def drafter_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores (rotary buffers are derived, never stored)."""
    return {k: v for k, v in drafter.state_dict().items() if not k.startswith("rotary_emb.")}


def save_drafter(
    drafter: DFlashDrafter,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write config.json and model.safetensors into `out_dir` (created if needed); returns the directory."""
    out = Path(out_dir)
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in drafter_state_dict(drafter).items()
    }
    check_finite(tensors, f"drafter to save in {out}")
    check_draft_map(tensors, drafter.config, f"drafter to save in {out}")
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", **(metadata or {})})
    drafter.config.save(out / CONFIG_NAME)
    return out


def weight_files(path: Path) -> list[Path]:
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    if (path / INDEX_NAME).is_file():
        try:
            index = json.loads((path / INDEX_NAME).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{path / INDEX_NAME}: malformed safetensors index ({e})") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard files named by {INDEX_NAME} are missing: {missing}")
        return [path / n for n in names]
    raise CheckpointError(f"{path}: no {WEIGHTS_NAME} (or {INDEX_NAME}) found; expected a drafter checkpoint directory")


SERVING_ONLY = ("d2t", "t2d", "lm_head.weight")  # tensors of the serving layout that dflashkit derives instead
MASK_FILE = "mask_embedding.pt"  # vLLM's override file for a learned mask embedding


# DeepSpec's Qwen3DSparkModel saves frozen full-vocabulary copies of the target's input embeddings and LM head with
# the drafter; dflashkit takes both from the target (`dflashkit convert SRC OUT --target T` checks and drops them).
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
IMPORT_HINT = (
    "DeepSpec's frozen copies of the target's tables: import the checkpoint with `dflashkit convert SRC OUT --target "
    "T`, which checks them against the target and drops them"
)


def target_copies(tensors: dict[str, torch.Tensor], cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """The target tables a DeepSpec DSpark checkpoint carries: (vocab_size, hidden_size) tensors named as in
    TARGET_COPIES, in a DSpark checkpoint without a vocabulary map (the serving layout's lm_head rows are not)."""
    if not head_of(cfg).format.carries_target_tables or "d2t" in tensors:
        return {}
    want = (cfg.vocab_size, cfg.hidden_size)
    return {k: tensors[k] for k in TARGET_COPIES if k in tensors and tuple(tensors[k].shape) == want}


def deepspec_hint(unexpected: list[str], cfg: DrafterConfig) -> str | None:
    """How to import a DSpark checkpoint whose only unexpected tensors are the target tables DeepSpec saves."""
    copies = head_of(cfg).format.carries_target_tables and set(unexpected) <= set(TARGET_COPIES)
    return IMPORT_HINT if unexpected and copies else None


def from_serving_layout(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The serving layout's tensors as dflashkit's own: `d2t` offsets → absolute `draft_to_target`; `t2d` and the
    LM-head rows dropped (the drafter takes them from the target). Other layouts pass through unchanged."""
    if "d2t" not in tensors:  # no vocabulary map: not the serving layout (a stray lm_head stays unexpected)
        return tensors
    out = {k: v for k, v in tensors.items() if k not in SERVING_ONLY}
    d2t = tensors.get("d2t")
    if d2t is not None and "draft_to_target" not in tensors:
        if d2t.is_floating_point() or d2t.dim() != 1:
            raise CheckpointError(f"{source}: tensor 'd2t' must be a 1-D integer tensor of offsets, got {d2t.dtype}")
        out["draft_to_target"] = torch.arange(d2t.shape[0], dtype=torch.long) + d2t.long()  # target = draft + d2t
    head = tensors.get("lm_head.weight")
    if head is not None and (d2t is not None and head.shape[0] != d2t.shape[0]):
        raise CheckpointError(
            f"{source}: lm_head.weight has {head.shape[0]} rows but d2t maps {d2t.shape[0]} draft ids; expected one "
            f"row per draft id"
        )
    return out


def check_mask_file(path: Path, tensors: dict[str, torch.Tensor], mask_token_id: int) -> None:
    """A `mask_embedding.pt` next to the weights is what vLLM feeds at masked slots: it must equal the drafter's
    own `mask_embedding` (and name the config's mask token), or an engine would run another drafter."""
    f = path / MASK_FILE
    if not f.is_file():
        return
    try:
        state = torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises many types for a damaged pickle
        raise CheckpointError(f"{f}: unreadable ({e}); expected {{'mask_token_id', 'embedding'}} or a tensor") from None
    vec = state.get("embedding") if isinstance(state, dict) else state
    if isinstance(state, dict) and state.get("mask_token_id", mask_token_id) != mask_token_id:
        raise CheckpointError(
            f"{f}: mask_token_id {state.get('mask_token_id')} ≠ config.json's mask_token_id {mask_token_id}"
        )
    own = tensors.get("mask_embedding")
    if not isinstance(vec, torch.Tensor) or own is None or not torch.equal(vec.reshape(-1).to(own.dtype), own):
        raise CheckpointError(
            f"{f}: does not hold this drafter's mask_embedding tensor; vLLM would feed it at masked slots — "
            f"re-export with `{shell_line('dflashkit', 'convert', path, 'OUT', '--to', 'vllm')}`"
        )


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded), on CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(Path(path)):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for key in list(handle.keys()):
                    tensors[key] = handle.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
    return tensors


def _shape_hint(key: str, cfg: DrafterConfig, found: tuple[int, ...]) -> str:
    if key == "fc.weight" and len(found) == 2 and found[1] % cfg.hidden_size == 0:
        return (
            f" — the fc reads {found[1] // cfg.hidden_size} target layers but config.json names "
            f"{cfg.num_features} (target_layer_ids {cfg.target_layer_ids})"
        )
    return ""


def check_tensors(
    tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], cfg: DrafterConfig, source: str
) -> None:
    """Strict key, shape and dtype check with messages naming every offending key: a float weight stored as
    integers (or a map stored as floats) would otherwise be cast without a word by `load_state_dict`."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        copies = set(target_copies(tensors, cfg)) & set(unexpected)
        problems.append(f"unexpected keys {unexpected}" + (f" ({IMPORT_HINT})" if copies else ""))
    if problems:
        raise CheckpointError(f"{source}: checkpoint does not match its config: " + "; ".join(problems))
    for key, ref in expected.items():
        found = tuple(tensors[key].shape)
        if found != tuple(ref.shape):
            raise CheckpointError(
                f"{source}: tensor '{key}' has shape {list(found)}, expected {list(ref.shape)}"
                + _shape_hint(key, cfg, found)
            )
        if tensors[key].is_floating_point() != ref.is_floating_point():
            kind = "a floating-point tensor" if ref.is_floating_point() else "an integer tensor"
            raise CheckpointError(
                f"{source}: tensor '{key}' has dtype {str(tensors[key].dtype).replace('torch.', '')}; expected {kind}"
            )
    check_draft_map(tensors, cfg, source)


def draft_map_problem(ids: torch.Tensor, vocab_size: int) -> str | None:
    """What is wrong with a draft vocabulary map (draft id → target id), or None: every id a row of the target's
    vocabulary, none twice (a map of one id repeated is a vocabulary that was never built from data)."""
    ids = ids.reshape(-1).long()
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.numel():
        return (
            f"names {outside.numel()} id(s) outside the target's vocabulary (0 ≤ id < {vocab_size}), e.g. "
            f"{int(outside[0])}"
        )
    unique = torch.unique(ids)
    if unique.numel() != ids.numel():
        return (
            f"names {ids.numel()} draft ids but only {unique.numel()} distinct target ids; expected distinct ids "
            f"(a draft vocabulary is built from data: `dflashkit init-drafter … --draft-vocab-from TOKENS`)"
        )
    return None


def check_draft_map(tensors: dict[str, torch.Tensor], cfg: DrafterConfig, source: str) -> None:
    """Refuse a reduced draft vocabulary whose map `draft_map_problem` finds wrong: it would index past the target's
    LM head while decoding, or draft one token under many ids."""
    ids = tensors.get("draft_to_target")
    if ids is not None and cfg.draft_vocab_size is not None:
        why = draft_map_problem(ids, cfg.vocab_size)
        if why:
            raise CheckpointError(f"{source}: tensor 'draft_to_target' {why}")


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights holding inf/NaN: such a drafter drafts nothing useful, and nothing of it may be exported."""
    for key, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            n = int((~torch.isfinite(t)).sum())
            raise CheckpointError(
                f"{source}: tensor '{key}' holds {n} non-finite (inf/NaN) value(s); expected finite weights "
                f"(`dflashkit inspect` lists every such tensor; use an earlier checkpoint or retrain)"
            )


def load_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"drafter checkpoint {path} does not exist")
    if not (path / CONFIG_NAME).is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME} (expected a drafter checkpoint directory)")
    try:
        return DrafterConfig.load(path / CONFIG_NAME)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def load_drafter(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> DFlashDrafter:
    """Load a z-lab-format drafter strictly (ours, z-lab's, or converted)."""
    path = Path(path)
    cfg = load_config(path)
    aliases = head_of(cfg).format.key_aliases  # names other writers of this kind use (z-lab's nn.Embedding codebooks)
    tensors = {aliases.get(k, k): v for k, v in from_serving_layout(read_tensors(path), str(path)).items()}
    check_mask_file(path, tensors, cfg.mask_token_id)
    with torch.device("meta"):
        skeleton = DFlashDrafter(cfg)
    check_tensors(tensors, drafter_state_dict(skeleton), cfg, str(path))
    check_finite(tensors, str(path))
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True)  # rotary buffers are non-persistent: rebuilt, not stored
    return drafter.to(device=device, dtype=dtype)


def with_head(drafter: DFlashDrafter, config: DrafterConfig, seed: int) -> DFlashDrafter:
    """A drafter of `config` (another kind, the same backbone) starting from `drafter`'s weights: the backbone is
    copied, the new head's own parameters start at their initialisation (seeded) — a no-op where the head makes it
    one (DFlash2's convolutions), so a DFlash checkpoint warm-starts it. Tensors of the old head that the new one has
    no place for are refused by name."""
    old = drafter_state_dict(drafter)
    torch.manual_seed(seed)
    new = DFlashDrafter(config)
    extra = sorted(set(old) - set(drafter_state_dict(new)))
    if extra:
        raise CheckpointError(
            f"init_from: a kind={drafter.config.kind} drafter's own tensors {extra[:3]} have no place in a "
            f"kind={config.kind} drafter; warm-start from a DFlash checkpoint (or one of the same kind)"
        )
    new.load_state_dict(old, strict=False)
    return new.to(device=drafter.device, dtype=drafter.dtype)


def describe(path: str | Path) -> dict[str, Any]:
    """Small summary used by `info` and reports: size on disk and parameter count."""
    path = Path(path)
    files = weight_files(path)
    return {"path": str(path), "bytes": sum(f.stat().st_size for f in files)}
