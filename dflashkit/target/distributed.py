"""torch.distributed for any stage launched by torchrun (training, feature capture): rank facts from torchrun's
environment and collectives that are identities on one process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from dflashkit.errors import ConfigError


@dataclass
class DistContext:
    """Rank facts from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); world 1 and no process group without
    them. Under torchrun a process group exists at any world size, one rank included: `--nproc_per_node 1` runs the
    distributed path (DDP, FSDP2, sharded capture) over NCCL on a single GPU."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialised_here: bool = False
    group: bool = False  # a process group joins the ranks (torchrun launched this process)

    @classmethod
    def from_env(cls, *, use_cuda: bool, timeout: timedelta = timedelta(minutes=30)) -> DistContext:
        """The process group torchrun asks for (nccl on CUDA, gloo on CPU); `timeout` bounds every collective."""
        world, rank, local = read_env()
        if not any(os.environ.get(k, "") != "" for k in TORCHRUN_VARS):
            return cls()
        import torch.distributed as dist

        here = False
        if not dist.is_initialized():
            if use_cuda:
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
            here = True
        return cls(rank=rank, world_size=world, local_rank=local, initialised_here=here, group=True)

    @property
    def distributed(self) -> bool:
        return self.group or self.world_size > 1

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


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def read_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun's variables; (1, 0, 0) when none is set. A half-set
    environment (WORLD_SIZE without RANK, a rank past the world, a non-number) is a ConfigError naming the
    variables, before any process group waits for peers that will never come."""
    present = {k: os.environ[k] for k in TORCHRUN_VARS if os.environ.get(k, "") != ""}
    if not present:
        return 1, 0, 0
    where = "the torchrun environment (" + ", ".join(f"{k}={v}" for k, v in present.items()) + ")"
    values = {}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if k in present:
            try:
                values[k] = int(present[k])
            except ValueError:
                raise ConfigError(f"{where}: {k} = {present[k]!r}: expected an integer") from None
    world = values.get("WORLD_SIZE", 1)
    if world < 1:
        raise ConfigError(f"{where}: WORLD_SIZE = {world}: expected an integer ≥ 1")
    if world == 1 and values.get("RANK", 0) == 0 and "MASTER_ADDR" not in present:
        return 1, 0, values.get("LOCAL_RANK", 0)  # a one-process launch (or a leftover LOCAL_RANK): no group
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in present]
    if missing:
        raise ConfigError(
            f"{where}: {', '.join(missing)} not set; expected all of RANK, WORLD_SIZE, MASTER_ADDR "
            f"and MASTER_PORT (launch with torchrun), or none of them for one process"
        )
    rank = values["RANK"]
    if not 0 <= rank < world:
        raise ConfigError(f"{where}: RANK = {rank}: expected 0 ≤ RANK < WORLD_SIZE {world}")
    return world, rank, values.get("LOCAL_RANK", 0)


__all__ = ["TORCHRUN_VARS", "DistContext", "read_env"]
