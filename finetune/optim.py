"""Optimizer and learning-rate schedule for the trainable parameters."""

from __future__ import annotations

from finetune.config.schema import TrainSection
from finetune.errors import FtError

NO_DECAY = ("bias", "norm", "ln_", "layernorm")


def param_groups(model, weight_decay: float) -> list[dict]:
    """Trainable parameters, with no weight decay on biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or any(k in name.lower() for k in NO_DECAY) else decay).append(p)
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]


def build_optimizer(model, train: TrainSection, lr: float):
    groups = param_groups(model, train.weight_decay)
    kind = train.optimizer
    if kind in ("adamw_torch", "adamw_torch_fused"):
        import torch

        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=kind.endswith("fused") or None)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise FtError(f"train.optimizer: {kind} needs bitsandbytes ({e}); install it or use adamw_torch") from None
    cls = {
        "adamw_8bit": bnb.optim.AdamW8bit,
        "paged_adamw_8bit": bnb.optim.PagedAdamW8bit,
        "paged_adamw_32bit": bnb.optim.PagedAdamW32bit,
    }[kind]
    return cls(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)


def build_scheduler(optimizer, train: TrainSection, total_steps: int):
    """Linear warmup, then cosine / linear decay to zero, or constant."""
    from transformers import get_scheduler

    warmup = train.warmup_steps or int(round(train.warmup_ratio * total_steps))
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[train.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=min(warmup, total_steps), num_training_steps=total_steps)
