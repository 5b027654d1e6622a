"""torch.distributed for training: the rank facts and collectives of `dflashkit.target.distributed` (re-exported),
and the teardown of a DDP wrapper (see `Run.close` in train/run.py for the order that cannot hang)."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dflashkit.target.distributed import TORCHRUN_VARS, DistContext, read_env


def drop_reducer(module: nn.Module) -> None:
    """Delete a (possibly compiled) DDP module's Reducer and the Logger that references it."""
    ddp = getattr(module, "_orig_mod", module)
    if isinstance(ddp, DDP):
        for name in ("logger", "reducer"):
            if name in ddp.__dict__:
                delattr(ddp, name)


__all__ = ["TORCHRUN_VARS", "DistContext", "drop_reducer", "read_env"]
