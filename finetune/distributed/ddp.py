"""torch DistributedDataParallel: a full replica per rank, gradients all-reduced after the last micro-batch."""

from __future__ import annotations

import contextlib

import torch


def wrap(model, device: torch.device):
    """The model wrapped in DDP (only trainable parameters are synchronised)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=False)


def accumulating(model, last: bool):
    """Skip the gradient all-reduce on every micro-batch but the last of a step."""
    return contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()


def unwrap(model):
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
