"""torch.distributed for training: rank facts from torchrun's environment, collectives that are identities on one
process, and the teardown of a DDP wrapper (see `Run.close` in train_state.py for the order that cannot hang)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class DistContext:
    """Rank facts from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); world 1 without them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialised_here: bool = False

    @classmethod
    def from_env(cls, *, use_cuda: bool) -> DistContext:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        here = False
        if not dist.is_initialized():
            if use_cuda:
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))
            here = True
        return cls(rank=rank, world_size=world, local_rank=local, initialised_here=here)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce (sum or max); identity on one process."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.initialised_here:
            import torch.distributed as dist

            dist.destroy_process_group()


def drop_reducer(module: nn.Module) -> None:
    """Delete a (possibly compiled) DDP module's Reducer and the Logger that references it."""
    ddp = getattr(module, "_orig_mod", module)
    if isinstance(ddp, DDP):
        for name in ("logger", "reducer"):
            if name in ddp.__dict__:
                delattr(ddp, name)
