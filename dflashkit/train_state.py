"""Training state: the live `Run` (setup, resume), checkpoints, the `latest` pointer, RNG states, torch.distributed.

`setup_run(cfg)` builds everything a training loop needs — process group, target (frozen embeddings + LM head,
or the whole target for online features / KL), feature source, packed rows, drafter (fresh, `init_from`, or
resumed from `out/latest` after checking that the config still matches), DDP/FSDP2 wrapper, AdamW, the cosine
schedule, the metrics logger — and returns it as a `Run`.

Layout of a run directory (`out`):

    out/checkpoints/step-000123/   config.json + model.safetensors (z-lab drafter), train_state.pt,
                                   train_config.yaml (the resolved TrainConfig)
    out/latest                     text file naming the newest complete checkpoint ("checkpoints/step-000123")
    out/final/                     z-lab checkpoint of the finished (or time-budget-stopped) run

A checkpoint directory is written under a temporary name and renamed into place, and `latest` is replaced
atomically after it, so a kill at any moment leaves the previous checkpoint usable. `train_state.pt` holds only
tensors and plain Python values (optimizer and scheduler state dicts, RNG states, counters) and is read with
`torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import random
import shutil
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dflashkit.checkpoint import save_drafter
from dflashkit.config import DrafterConfig
from dflashkit.distributed import DistContext, drop_reducer
from dflashkit.errors import CheckpointError, ConfigError, DataError
from dflashkit.io_utils import atomic_write_text, remove_stale_temps, write_failure
from dflashkit.losses import decay_weights
from dflashkit.metrics import MetricsLogger, RollingStats
from dflashkit.model import DFlashDrafter
from dflashkit.packing import (PackedRows, plan_rows, sample_lengths, split_indices, steps_per_epoch,
                               supervision_problem)

STATE_NAME = "train_state.pt"
CONFIG_YAML = "train_config.yaml"
LATEST_NAME = "latest"


# ---------------------------------------------------------------------------------------------- state
@dataclass
class TrainState:
    """Counters that, with the optimizer/scheduler states and the config, define where a run stands."""

    step: int = 0                  # optimizer steps completed
    epoch: int = 0                 # epoch of the next step
    batch_in_epoch: int = 0        # step index within that epoch
    clipped_steps: int = 0
    tokens_seen: int = 0
    world_size: int = 1
    elapsed_s: float = 0.0         # training time over all sessions
    recent_losses: list[float] = field(default_factory=list)
    best_val_tau: float | None = None  # keep_best: the highest validation τ so far, and its step (OUT/best)
    best_val_step: int = 0


def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), Python and NumPy as tensors / plain values."""
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------- files
def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint named by `out/latest`, or None for a fresh run directory."""
    out = Path(out_dir)
    pointer = out / LATEST_NAME
    if not pointer.is_file():
        return None
    rel = pointer.read_text().strip()
    path = out / rel
    if not (path / STATE_NAME).is_file():
        raise CheckpointError(f"{pointer} names {rel}, which has no {STATE_NAME}; remove {pointer} to start over")
    return path


def save_checkpoint(out_dir: str | Path, *, drafter: DFlashDrafter, optimizer: dict[str, Any],
                    scheduler: dict[str, Any], state: TrainState, config: dict[str, Any],
                    keep: int = 0) -> Path:
    """Write out/checkpoints/step-N atomically, point `latest` at it, prune old ones; returns the directory."""
    out = Path(out_dir)
    root = out / "checkpoints"
    final = root / checkpoint_name(state.step)
    if not (final / STATE_NAME).is_file():          # same step twice (e.g. save_every then stop): keep the first
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            save_drafter(drafter, tmp, metadata={"step": str(state.step)})
            torch.save({"optimizer": optimizer, "scheduler": scheduler, "rng": capture_rng(),
                        "state": asdict(state)}, tmp / STATE_NAME)
            (tmp / CONFIG_YAML).write_text(yaml.safe_dump(config, sort_keys=False))
        except (OSError, RuntimeError, SafetensorError) as e:   # a full disk, as torch / safetensors report it
            shutil.rmtree(tmp, ignore_errors=True)
            raise _save_failed(out, final, e) from None
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    try:
        atomic_write_text(out / LATEST_NAME, f"checkpoints/{final.name}\n")
    except OSError as e:
        raise _save_failed(out, out / LATEST_NAME, e) from None
    if keep > 0:
        steps = sorted(p for p in root.glob("step-*") if p.is_dir() and p != final)
        for old in steps[: max(0, len(steps) - (keep - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _save_failed(out: Path, path: Path, error: BaseException) -> CheckpointError:
    """The one-line error for a failed checkpoint write; the previous checkpoint is untouched by then."""
    pointer = out / LATEST_NAME
    prev = pointer.read_text().strip() if pointer.is_file() else None
    kept = (f"the previous checkpoint {out / prev} is intact (resume from it: free space, then run the same "
            f"command again)" if prev else "no earlier checkpoint exists")
    return CheckpointError(f"cannot write {path}: {write_failure(path, error)}; {kept}")


def save_final(out_dir: str | Path, drafter: DFlashDrafter, *, step: int, name: str = "final") -> Path:
    """Write out/NAME (z-lab checkpoint: final, or best), replacing an older one only once the new one is complete."""
    out = Path(out_dir)
    final = out / name
    tmp = out / f".{name}.tmp-{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        save_drafter(drafter, tmp, metadata={"step": str(step)})
    except (OSError, RuntimeError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(out, final, e) from None
    old = out / f".{name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
    return final


def load_checkpoint_state(path: str | Path) -> dict[str, Any]:
    """train_state.pt of a checkpoint directory (weights_only: tensors and plain values only)."""
    f = Path(path) / STATE_NAME
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file: say which and why
        raise CheckpointError(f"{f}: cannot read training state ({type(e).__name__}: {e})") from None


def load_saved_config(path: str | Path) -> dict[str, Any]:
    f = Path(path) / CONFIG_YAML
    if not f.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_YAML}; cannot check that the resumed run matches")
    return yaml.safe_load(f.read_text()) or {}


__all__ = ["DrafterStep", "DistContext", "Run", "TrainState", "capture_rng", "checkpoint_name", "cosine_at",
           "cosine_with_warmup", "latest_checkpoint", "open_feature_source", "setup_run",
           "load_checkpoint_state", "load_saved_config", "restore_rng", "save_checkpoint", "save_final"]


# ---------------------------------------------------------------------------------------------- the run
class DrafterStep(nn.Module):
    """What DDP / FSDP / torch.compile wrap: block embeddings (target table, frozen) + the drafter forward."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor) -> None:
        super().__init__()
        self.drafter = drafter
        self.embed_weight = [embed_weight]      # a list: neither a parameter nor a buffer (never synced/saved)

    def forward(self, features: torch.Tensor, first_tokens: torch.Tensor, context_positions: torch.Tensor,
                block_positions: torch.Tensor, masks: dict[str, Any]) -> torch.Tensor:
        bs = self.drafter.config.block_size
        embeds = self.drafter.block_embeddings(first_tokens, self.embed_weight[0], bs)   # (B, Nb·bs, H)
        return self.drafter(features, embeds, context_positions=context_positions,
                            block_positions=block_positions, attention_mask=masks)      # (B, Nb·bs, H)


def cosine_at(progress: float, warmup: float, min_ratio: float = 0.0) -> float:
    """LR multiplier at `progress` ∈ [0, 1] of a run: linear warmup over the first `warmup` fraction (from 1 % of
    the peak), then cosine down to `min_ratio` at progress 1. For time-based schedules (`schedule_minutes`)."""
    if progress < warmup:
        return max(progress, 0.01 * warmup) / warmup
    return _cosine_decay((progress - warmup) / max(1e-9, 1 - warmup), min_ratio)


def _cosine_decay(progress: float, min_ratio: float) -> float:
    """1 at progress 0 down to `min_ratio` at progress ≥ 1, along half a cosine."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def cosine_with_warmup(total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """LR multiplier for LambdaLR: linear warmup to 1 over `warmup_steps`, then cosine down to `min_ratio`."""
    def fn(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        return _cosine_decay((s - warmup_steps) / max(1, total_steps - warmup_steps), min_ratio)
    return fn


def open_feature_source(cfg: Any, target: Any, drafter_config: DrafterConfig) -> Any:
    """The configured feature source: captured features (`features`) or online ones (`tokens`, online: true).
    With loss: topk, captured features must hold the top-k log-probs (a DataError naming the directory and the
    fix otherwise) and online ones compute them (`topk`, default DEFAULT_ONLINE_TOPK entries)."""
    from dflashkit import features as feats
    from dflashkit.samples import read_tokens
    from dflashkit.train_config import DEFAULT_ONLINE_TOPK

    ids = list(drafter_config.target_layer_ids)
    if cfg.features is None and cfg.tokens is None:
        raise ConfigError("no training data: set features (a `dflashkit capture` directory) or tokens "
                          "(tokens.jsonl from `dflashkit prepare`) with online: true")
    if cfg.features is not None:
        return feats.CapturedFeatures(cfg.features, expect_target=target, expect_layer_ids=ids,
                                      require_topk=(cfg.topk or 1) if cfg.loss == "topk" else 0)
    samples, _ = read_tokens(cfg.tokens)
    topk = (cfg.topk or DEFAULT_ONLINE_TOPK) if cfg.loss == "topk" else 0
    return feats.OnlineFeatures(target, samples, layer_ids=ids, store_topk=min(topk, target.vocab_size))


def _resolve_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(spec)


def _check_same_drafter(saved: DrafterConfig, wanted: DrafterConfig, where: str) -> None:
    for f in fields(DrafterConfig):
        if f.name == "extra":
            continue
        a, b = getattr(saved, f.name), getattr(wanted, f.name)
        if a != b:
            raise ConfigError(f"cannot resume {where}: the checkpoint's drafter has {f.name} = {a!r} but this "
                              f"config builds {b!r}; use a new `out` directory")


@dataclass
class Run:
    """Everything the training loop holds. `drafter` is the plain module; `module` is what runs (wrapped)."""

    cfg: Any
    dist: DistContext
    device: torch.device
    out: Path
    target: Any
    embed: torch.Tensor                # (V, H) frozen, on device
    lm_head: torch.Tensor              # (V, H) frozen, on device
    drafter: DFlashDrafter
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rows: PackedRows
    val_rows: PackedRows | None
    steps_per_epoch: int
    total_steps: int
    state: TrainState
    logger: MetricsLogger
    rolling: RollingStats
    weights: torch.Tensor              # (bs,) slot weights
    autocast_dtype: torch.dtype | None
    info: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None

    def autocast(self) -> Any:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    @property
    def fsdp(self) -> bool:
        return bool(self.cfg.fsdp)

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """Skip the gradient all-reduce / reduce-scatter on accumulation micro-batches (DDP, FSDP2)."""
        if isinstance(self.module, DDP):
            with self.module.no_sync():
                yield
        elif self.fsdp:
            self.module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)
        else:
            yield

    def gather_state(self) -> tuple[DFlashDrafter, dict[str, Any]]:
        """(drafter to save, optimizer state dict). Collective under FSDP: every rank must call it; the full
        tensors land on rank 0 (other ranks get an unusable drafter and an empty dict)."""
        if not self.fsdp:
            return self.drafter, self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.module, options=opts)                 # keys "drafter.…"
        optim = get_optimizer_state_dict(self.module, self.optimizer, options=opts)
        drafter = DFlashDrafter(self.drafter.config) if self.dist.is_main else self.drafter
        if self.dist.is_main:
            drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in full.items()}, strict=True)
        return drafter, optim

    def close(self) -> None:
        """Close the logger and end the process group — in an order that cannot deadlock.

        DDP's C++ Reducer holds a reference to the gloo process group. Destroyed after
        `destroy_process_group()`, the Reducer is the group's last owner: its destructor (run with the GIL held)
        joins a gloo worker thread that needs the GIL to free its last work item — a hang at exit. So the
        wrapper goes first, while the group is alive, and only then the group.
        """
        self.logger.close()
        wrapper = weakref.ref(self.module)
        self.module = self.drafter
        gc.collect()                        # DDP/FSDP wrappers sit in reference cycles
        alive = wrapper()
        if alive is not None:               # someone still holds the wrapper: free its Reducer at least
            drop_reducer(alive)
            del alive
            gc.collect()
        self.dist.close()


def setup_run(cfg: Any, *, dataset: Any = None, target: Any = None) -> Run:
    """Build a `Run` from a TrainConfig (resuming from `cfg.out/latest` when it exists)."""
    from dflashkit.checkpoint import load_drafter
    from dflashkit.info import default_drafter_config
    from dflashkit.target import Target, check_drafter_fits
    from dflashkit.train_config import check_resume_compatible

    cfg.validate()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = _resolve_device(cfg.drafter_device, local)
    dist = DistContext.from_env(use_cuda=device.type == "cuda")
    if cfg.fsdp and not dist.distributed:
        raise ConfigError("fsdp: true shards the drafter over ranks; launch with torchrun (≥ 2 processes) or "
                          "set fsdp: false")
    main = dist.is_main
    out = Path(cfg.out)
    if main:   # temp checkpoint dirs of killed runs or failed (disk-full) saves
        for d in (out / "checkpoints", out):
            remove_stale_temps(d, log=lambda msg: print(f"[dflashkit train] {msg}", flush=True))
    if target is None:
        tdev = device if cfg.target_device == "auto" else torch.device(cfg.target_device)
        target = Target.load(cfg.target, device=tdev, trust_remote_code=cfg.trust_remote_code)
    wanted = default_drafter_config(target, **cfg.drafter)
    ckpt = latest_checkpoint(out)
    blob = None
    if ckpt is not None:
        check_resume_compatible(load_saved_config(ckpt), cfg, where=f"from {ckpt}")
        blob = load_checkpoint_state(ckpt)
        if blob["state"]["world_size"] != dist.world_size:
            raise ConfigError(f"cannot resume from {ckpt}: world_size was {blob['state']['world_size']} but is "
                              f"{dist.world_size} now (the global batch would change)")
        drafter = load_drafter(ckpt)
        if cfg.init_from is None:
            _check_same_drafter(drafter.config, wanted, f"from {ckpt}")
    elif cfg.init_from is not None:
        drafter = load_drafter(cfg.init_from)
    else:
        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter(wanted)
    check_drafter_fits(drafter.config, target, source="drafter")
    if cfg.loss == "kl" and drafter.config.draft_vocab_size is not None:
        raise ConfigError("loss: kl needs the full vocabulary; this drafter has a reduced draft vocabulary "
                          f"(draft_vocab_size {drafter.config.draft_vocab_size}) — use loss: ce")
    drafter = drafter.to(device=device, dtype=torch.float32).train()

    source = dataset if dataset is not None else open_feature_source(cfg, target, drafter.config)
    lengths = sample_lengths(source)
    train_idx, val_idx = split_indices(len(lengths), val_fraction=cfg.val_fraction, val_samples=cfg.val_samples,
                                       seed=cfg.seed)
    plan = plan_rows({i: lengths[i] for i in train_idx}, max_tokens=cfg.max_tokens, seed=cfg.seed,
                     strategy=cfg.packing)
    problem = supervision_problem(source, plan)   # e.g. max_tokens shorter than every prompt: a loss of 0
    if problem:
        raise DataError(problem)
    val_plan = plan_rows({i: lengths[i] for i in val_idx}, max_tokens=cfg.max_tokens, seed=cfg.seed,
                         strategy=cfg.packing) if val_idx else None
    rows = PackedRows(source, plan)
    val_rows = PackedRows(source, val_plan) if val_plan is not None and len(val_plan) else None
    spe = steps_per_epoch(len(rows), batch_rows=cfg.batch_rows, grad_accum=cfg.grad_accum,
                          world_size=dist.world_size)
    # a time-based schedule without max_steps runs until its training time is spent (epochs do not cap it)
    unbounded = cfg.schedule_minutes is not None and cfg.max_steps is None
    total = cfg.max_steps if cfg.max_steps is not None else (10 ** 9 if unbounded else cfg.epochs * spe)

    embed = target.embed_weight.detach().to(device)
    lm_head = embed if target.lm_head_weight is target.embed_weight else target.lm_head_weight.detach().to(device)
    keep_target = cfg.online or cfg.loss == "kl"
    n_params = drafter.num_parameters()
    core = DrafterStep(drafter, embed)
    module: nn.Module = core
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in drafter.layers:        # one all-gather per decoder layer; fc/norms/mask vector at the root
            fully_shard(layer)
        fully_shard(core)
    elif dist.distributed:
        module = DDP(core, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        module = torch.compile(module, dynamic=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas),
                                  weight_decay=cfg.weight_decay)
    warmup = max(1, math.ceil(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
    lr_fn = cosine_with_warmup(total, warmup, cfg.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_fn)
    state = TrainState(world_size=dist.world_size)
    if blob is not None and cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(core, optimizer, optim_state_dict=blob["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    elif blob is not None:
        optimizer.load_state_dict(blob["optimizer"])
    if blob is not None:
        scheduler.load_state_dict(blob["scheduler"])
        # The saved lr came from the saved schedule; a changed run length (epochs/max_steps) re-shapes the
        # cosine, so take the next lr from the current one (the same value when nothing changed).
        for group, base in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base * lr_fn(scheduler.last_epoch)
        restore_rng(blob["rng"])
        state = TrainState(**blob["state"])
    logger = MetricsLogger(out, enabled=main, tensorboard=cfg.tensorboard,
                           resume_step=state.step if blob is not None else None)
    use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")
    info = {"samples": len(lengths), "train_samples": len(train_idx), "val_samples": len(val_idx),
            "rows": len(rows), "val_rows": len(val_rows) if val_rows is not None else 0,
            "truncated": plan.truncated, "fill": plan.fill, "steps_per_epoch": spe, "total_steps": total,
            "resumed_from": str(ckpt) if ckpt is not None else None, "parameters": n_params,
            "world_size": dist.world_size, "device": str(device)}
    if main:
        print(f"[dflashkit train] {info['train_samples']} samples → {info['rows']} rows (fill {plan.fill:.0%}, "
              f"{plan.truncated} truncated to {cfg.max_tokens} tokens), {info['val_samples']} held out; "
              f"{spe} steps/epoch, "
              + (f"steps until {cfg.schedule_minutes:g} min of training" if unbounded else f"{total} steps")
              + f"; drafter {info['parameters']:,} params on {device}"
              + (f"; resuming from {ckpt} at step {state.step}" if ckpt is not None else ""), flush=True)
    return Run(cfg=cfg, dist=dist, device=device, out=out, target=target if keep_target else None, embed=embed,
               lm_head=lm_head, drafter=drafter, module=module, optimizer=optimizer, scheduler=scheduler,
               rows=rows, val_rows=val_rows, steps_per_epoch=spe, total_steps=total, state=state, logger=logger,
               rolling=RollingStats(cfg.rolling_window, state.recent_losses),
               weights=decay_weights(drafter.config.block_size, cfg.gamma).to(device),
               autocast_dtype=torch.bfloat16 if use_bf16 else None, info=info)
