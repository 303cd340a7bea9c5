"""What the training loop calls on a wrapped model, the same for every backend.

An engine holds the model as the backend wrapped it, its optimizer and schedule, and answers:
`accumulating(last)` around each micro-batch, `backward(loss)`, `step()` once per optimizer step
(clip, update, schedule, zero the gradients; returns the gradient norm), `generation()` around sampling
(whole parameters on every rank), `save_shards`/`load_shards` for sharded checkpoints, and
`full_state_dict()` (a collective) for the final weights.
`TorchEngine` serves single-process, DDP and FSDP2 jobs; `deepspeed.ZeroEngine` DeepSpeed ZeRO.
"""

from __future__ import annotations

import contextlib

import torch

from finetune.distributed import ddp, fsdp


class TorchEngine:
    """torch's optimizer, clipping and (fp16) loss scaling around a plain, DDP or FSDP2 model."""

    def __init__(self, model, optimizer, scheduler, max_grad_norm: float, fp16: bool, device: torch.device):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None
        self.sharded = fsdp.is_sharded(model)  # checkpoints: every rank writes its shards
        self.gathers_parameters = self.sharded  # a forward pass needs every rank
        self.reshard_after_forward = True  # FSDP: false for shard_grad_op (set by `build`)

    @property
    def inner(self):
        """The model without its data-parallel wrapper."""
        return ddp.unwrap(self.model)

    def accumulating(self, last: bool):
        """Synchronise gradients only after the last micro-batch of a step."""
        return fsdp.accumulating(self.model, last) if self.sharded else ddp.accumulating(self.model, last)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> float:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a sharded norm
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def generation(self):
        """Whole parameters for the length of a generate() call (each rank samples its own lengths, so
        the per-layer all-gathers of a sharded forward would not line up across ranks)."""
        return fsdp.unsharded(self.model, self.reshard_after_forward) if self.sharded else contextlib.nullcontext()

    def save_shards(self, path) -> None:
        fsdp.save_sharded(path / "dcp", self.model, self.optimizer)

    def load_shards(self, path) -> None:
        fsdp.load_sharded(path / "dcp", self.model, self.optimizer)

    def full_state_dict(self, trainable_only: bool) -> dict | None:
        """Gathered weights on rank 0 for a sharded model; None when the model is whole on every rank."""
        return fsdp.full_state_dict(self.model, trainable_only) if self.sharded else None


def build(model, plan, train, distributed, device: torch.device, total_steps: int):
    """Wrap the model per the plan's backend and give it its optimizer and schedule (the only place that looks at plan.backend)."""
    from finetune.optim import build_optimizer, build_scheduler

    if plan.backend == "deepspeed":
        from finetune.distributed import deepspeed

        return deepspeed.wrap(model, plan, train, distributed, total_steps)
    if plan.backend == "ddp":
        model = ddp.wrap(model, device)
    elif plan.backend == "fsdp":
        model = fsdp.wrap(model, plan.precision, plan.sharding, plan.nodes, plan.processes_per_node, device, offload=plan.offload == "all")
    optimizer = build_optimizer(model, train, plan.lr)  # after sharding: FSDP2 parameters are DTensors
    scheduler = build_scheduler(optimizer, train, total_steps)
    engine = TorchEngine(model, optimizer, scheduler, train.max_grad_norm, plan.precision == "fp16", device)
    engine.reshard_after_forward = plan.sharding != "shard_grad_op"
    return engine

