"""The process group of a multi-process job: start it, reduce scalars over it, and know who is rank 0.

A single-process job gets a `Runtime` with world size 1 whose operations do nothing, so the training
loop calls the same functions whatever the backend.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Runtime:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, value: float) -> float:
        """Sum of a number over all ranks."""
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item())

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on one (e.g. a stop signal received by one rank)."""
        return self.sum(1.0 if flag else 0.0) > 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()


def launched() -> bool:
    """True inside a process started by torchrun (or another launcher that sets the standard variables)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def start(timeout_minutes: int) -> Runtime:
    """Join the process group torchrun set up (gloo on CPU, nccl on GPUs); a single process gets a no-op Runtime."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return Runtime()
    rank, local, world = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return Runtime(rank, local, world)


def stop(runtime: Runtime) -> None:
    if runtime.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
