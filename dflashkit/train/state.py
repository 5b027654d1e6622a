"""Training state on disk: checkpoints, the `latest` pointer, `final/` and `best/`, RNG states, counters.

Layout of a run directory (`out`):

    out/checkpoints/step-000123/   config.json + model.safetensors (z-lab drafter), train_state.pt,
                                   train_config.yaml (the resolved TrainConfig)
    out/latest                     text file naming the newest complete checkpoint ("checkpoints/step-000123")
    out/final/                     z-lab checkpoint of the finished (or time-budget-stopped) run
    out/best/                      keep_best: the drafter of the best validation pass (+ best.json)

A checkpoint directory is written under a temporary name and renamed into place, and `latest` is replaced
atomically after it, so a kill at any moment leaves the previous checkpoint usable. `train_state.pt` holds only
tensors and plain Python values (optimizer and scheduler state dicts, RNG states, counters) and is read with
`torch.load(..., weights_only=True)`. The live run that writes them is `dflashkit.train.run.Run`.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError

from dflashkit.drafter.checkpoint import save_drafter
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError
from dflashkit.io_utils import atomic_write_text, write_failure
from dflashkit.validation import load_yaml

STATE_NAME = "train_state.pt"
CONFIG_YAML = "train_config.yaml"
LATEST_NAME = "latest"


# ---------------------------------------------------------------------------------------------- state
@dataclass
class TrainState:
    """Counters that, with the optimizer/scheduler states and the config, define where a run stands."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # epoch of the next step
    batch_in_epoch: int = 0  # step index within that epoch
    clipped_steps: int = 0
    tokens_seen: int = 0
    world_size: int = 1
    elapsed_s: float = 0.0  # training time over the first run and every resume
    recent_losses: list[float] = field(default_factory=list)
    best_val_tau: float | None = None  # keep_best: the highest validation τ so far, and its step (OUT/best)
    best_val_step: int = 0
    optimizer_impl: str = "default"  # AdamW's implementation, fixed for the run (a state that records none: torch's)
    precision: str = ""  # "fp32" / "bf16", fixed for the run (a state that records none: fp32 on CPU, bf16 on CUDA)


def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), Python and NumPy as tensors / plain values."""
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached": float(np_state[4]),
        },
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
    """The checkpoint named by `out/latest`, or None for a fresh run directory. CheckpointError when `latest` names
    no checkpoint, or when it is missing but checkpoints are there (a run killed between saving its first checkpoint
    and naming it, or a removed pointer): a fresh run would keep those stale files as its own steps."""
    out = Path(out_dir)
    pointer = out / LATEST_NAME
    saved = sorted(p for p in (out / "checkpoints").glob("step-*") if (p / STATE_NAME).is_file())
    fresh = f"use a new `out` directory (or remove {pointer} and {out / 'checkpoints'}) to start over"
    if not pointer.is_file():
        if saved:
            raise CheckpointError(
                f"{out / 'checkpoints'} holds saved checkpoints (newest {saved[-1].name}) but {pointer}, which names "
                f"the one to resume, is missing: write {saved[-1].relative_to(out)} into {pointer} to resume from it, "
                f"or {fresh}"
            )
        return None
    rel = pointer.read_text(errors="replace").strip()
    path = out / rel
    if not (path / STATE_NAME).is_file():
        newest = (
            f"the newest saved checkpoint here is {saved[-1].relative_to(out)}: write that into {pointer} to resume "
        )
        raise CheckpointError(
            f"{pointer} names {rel!r}, which has no {STATE_NAME}; " + (f"{newest}from it, or " if saved else "") + fresh
        )
    return path


def save_checkpoint(
    out_dir: str | Path,
    *,
    drafter: DFlashDrafter,
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    state: TrainState,
    config: dict[str, Any],
    keep: int = 0,
) -> Path:
    """Write out/checkpoints/step-N atomically, point `latest` at it, prune old ones; returns the directory."""
    out = Path(out_dir)
    root = out / "checkpoints"
    final = root / checkpoint_name(state.step)
    if not (final / STATE_NAME).is_file():  # same step twice (e.g. save_every then stop): keep the first
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            save_drafter(drafter, tmp, metadata={"step": str(state.step)})
            torch.save(
                {"optimizer": optimizer, "scheduler": scheduler, "rng": capture_rng(), "state": asdict(state)},
                tmp / STATE_NAME,
            )
            (tmp / CONFIG_YAML).write_text(yaml.safe_dump(config, sort_keys=False))
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, as torch / safetensors report it
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
    kept = (
        f"the previous checkpoint {out / prev} is intact (resume from it: free space, then run the same command again)"
        if prev
        else "no earlier checkpoint exists"
    )
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
    try:
        return load_yaml(f)[0]  # the one YAML door: a damaged file is named with its line, never a parser traceback
    except ConfigError as e:
        raise CheckpointError(
            f"{e}; the checkpoint's training config is damaged (restore it, or resume from an earlier checkpoint)"
        ) from None


__all__ = [
    "CONFIG_YAML",
    "LATEST_NAME",
    "STATE_NAME",
    "TrainState",
    "capture_rng",
    "checkpoint_name",
    "latest_checkpoint",
    "load_checkpoint_state",
    "load_saved_config",
    "restore_rng",
    "save_checkpoint",
    "save_final",
]
