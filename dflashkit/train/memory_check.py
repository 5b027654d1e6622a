"""Will a training run fit its device? The check `train` runs before it loads anything, and `doctor` reports:
the memory model (`train.memory`) applied to a `TrainConfig`, against the memory the device has.

    est = run_memory(cfg)                  # MemoryParts of cfg's step on its drafter device (config files only)
    problem = fit_problem(cfg)             # None, or one line: what it needs, what the device has, what to change

The row a step is sized for holds one document with `max_anchors` blocks (fewer when `max_tokens` is shorter):
the least a row of long documents needs. Rows of several short documents hold more blocks; `dflashkit plan`
sizes those from the data's expected lengths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.heads import head_of
from dflashkit.features.footprint import MemoryParts
from dflashkit.train.losses import DISTRIBUTION_KINDS
from dflashkit.train.memory import MemorySettings, StepShape, step_memory

# Memory kept free for what the model leaves out: the CUDA context, the allocator's fragmentation, libraries.
HEADROOM = 0.10


def run_drafter_config(cfg: Any, shape: Any) -> DrafterConfig:
    """The drafter a run trains, from files only: a resumed run's checkpoint, `init_from`'s config, or the default
    drafter for the target's shape with the config's `drafter:` overrides (the mask row is decided at load)."""
    from dflashkit.drafter.checkpoint import load_config
    from dflashkit.train.state import latest_checkpoint

    ckpt = latest_checkpoint(cfg.out) if Path(cfg.out).is_dir() else None
    if ckpt is not None or cfg.init_from:
        saved = load_config(ckpt if ckpt is not None else cfg.init_from)
        kind = dict(cfg.drafter).get("kind", saved.kind)
        if ckpt is None and kind != saved.kind:  # a warm start of another head on the checkpoint's backbone
            fields = {f: cfg.drafter[f] for f in head_of(kind).fields if f in cfg.drafter}
            saved = saved.replace(kind=kind, **fields)
        return saved
    overrides = {k: v for k, v in dict(cfg.drafter).items() if k not in ("mask_token_id", "learned_mask_embedding")}
    return DrafterConfig.for_target(
        hidden_size=shape.hidden_size,
        vocab_size=shape.vocab_size,
        num_target_layers=shape.num_layers,
        target_intermediate_size=shape.intermediate_size,
        mask_token_id=0,
        **overrides,
    )


def device_memory(device: torch.device, *, total: bool = False) -> int:
    """Bytes free on `device` now — a GPU's free memory, or the RAM this process could allocate — or its `total`
    (a process that already holds a target, such as doctor, asks for the total)."""
    if device.type == "cuda":
        free, whole = torch.cuda.mem_get_info(device)
        return int(whole if total else free)
    import psutil

    memory = psutil.virtual_memory()
    return int(memory.total if total else memory.available)


def run_memory(cfg: Any, *, shape: Any = None, device: torch.device | None = None, traced: bool = True) -> MemoryParts:
    """The memory model of one step of `cfg` on its drafter device (`shape`: the target's, read from cfg.target);
    `traced=False`: its lower bound in closed form (`step_memory`)."""
    from dflashkit.target.devices import resolve_device
    from dflashkit.target.distributed import read_env
    from dflashkit.target.shape import read_target_shape

    world, _, local = read_env()
    device = device or resolve_device(cfg.drafter_device, local)
    target_device = device if cfg.target_device == "auto" else torch.device(cfg.target_device)
    elsewhere = (target_device.type, target_device.index or 0) != (device.type, device.index or 0)
    shape = shape or read_target_shape(cfg.target, trust_remote_code=cfg.trust_remote_code)
    drafter = run_drafter_config(cfg, shape)
    # auto on a CPU is timed when the run starts (precision_choice): its fp32 step is the larger, so it is checked
    bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    settings = MemorySettings(
        device=device.type,
        precision="bf16" if bf16 else "fp32",
        layout="fsdp" if cfg.fsdp else ("ddp" if world > 1 else "single"),
        world=world,
        loss=cfg.loss,
        online=cfg.online,
        target_dtype_bytes=2 if target_device.type == "cuda" else 4,
        target_elsewhere=elsewhere,
        loss_chunk_rows=cfg.loss_chunk_size,
    )
    row = StepShape(rows=cfg.batch_rows, tokens=cfg.max_tokens, blocks=blocks_per_row(cfg))
    return step_memory(drafter, shape, row, settings, traced=traced)


def blocks_per_row(cfg: Any) -> int:
    """Blocks of a row holding one document: `max_anchors`, fewer when no document has that many supervised tokens
    (a capture's manifest says; a tokens file would need a full read) or the row is shorter."""
    blocks = min(cfg.max_anchors, cfg.max_tokens - 1)
    if cfg.features and not cfg.online:
        from dflashkit.features.manifest import Manifest

        samples = Manifest.load(Path(cfg.features)).samples
        most = max((int(s.get("supervised", s["length"])) for s in samples), default=blocks)
        blocks = min(blocks, max(1, most - 1))
    return max(1, blocks)


def fit_problem(cfg: Any, *, available: int | None = None, device: torch.device | None = None) -> str | None:
    """None when one step of `cfg` fits its device with HEADROOM to spare; else one line saying what it needs,
    what the device has and what to change."""
    from dflashkit.target.devices import resolve_device
    from dflashkit.target.distributed import read_env
    from dflashkit.target.shape import read_target_shape

    if str(cfg.target).endswith(".gguf"):  # the shape is read from config.json files
        return None
    device = device or resolve_device(cfg.drafter_device, read_env()[2])
    have = device_memory(device) if available is None else available
    shape = read_target_shape(cfg.target, trust_remote_code=cfg.trust_remote_code)
    # the closed-form lower bound first: a run far past the device is refused without tracing the drafter
    est, about = run_memory(cfg, shape=shape, device=device, traced=False), "at least"
    if est.peak <= have * (1 - HEADROOM):
        est, about = run_memory(cfg, shape=shape, device=device), "about"
    if est.peak <= have * (1 - HEADROOM):
        return None
    biggest = max({**est.parts, **est.phases}.items(), key=lambda kv: kv[1])
    changes = [f"max_anchors (now {cfg.max_anchors})", f"max_tokens (now {cfg.max_tokens})"]
    if cfg.batch_rows > 1:
        changes.append(f"batch_rows (now {cfg.batch_rows}; grad_accum keeps the batch)")
    if cfg.online or cfg.loss in DISTRIBUTION_KINDS:
        changes.append("online: false (offline features keep only the target's embedding table and LM head)")
    if not cfg.fsdp:
        changes.append("fsdp: true under torchrun (shards the drafter and its optimizer state)")
    return (
        f"this run needs {about} {est.peak / 2**30:,.1f} GiB on {device} per step (largest: {biggest[0]} "
        f"{biggest[1] / 2**30:,.1f} GiB) but {device} has {have / 2**30:,.1f} GiB available; lower "
        + ", ".join(changes[:-1])
        + f" or set {changes[-1]} (dflashkit plan sizes a run for a device)"
    )


__all__ = ["HEADROOM", "blocks_per_row", "device_memory", "fit_problem", "run_drafter_config", "run_memory"]
