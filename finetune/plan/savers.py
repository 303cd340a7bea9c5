"""Memory savers the planner may turn on, and the options each config allows.

Each saver trades time for memory: a chunked loss recomputes the output head, checkpointing recomputes layers,
activation offloading and host offload move bytes over PCIe, pure bf16 rounds updates, the optimizer step in backward
gives up gradient clipping and accumulation. The search (plan/search.py) tries every combination the config allows
and keeps the one with the least estimated step time among those that fit (plan/cost.py); pure bf16 changes the
numerics, so `auto` only turns it on when nothing fits in mixed precision.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from itertools import product

from finetune.catalog import ModelFacts
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware

CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk of the chunked loss
FUSED_PACKAGES = {"liger": "liger_kernel", "cut_cross_entropy": "cut_cross_entropy"}


@dataclass(frozen=True)
class Savers:
    """One combination of memory savers."""

    pure_bf16: bool = False
    loss: str = "plain"  # plain | chunked | liger | cut_cross_entropy
    checkpoint_layers: int = 0
    activation_offload: bool = False
    optimizer_in_backward: bool = False

    @property
    def estimator_loss(self) -> str:
        return self.loss if self.loss in ("plain", "chunked") else "fused"

    def describe(self, layers: int) -> str:
        parts = []
        if self.pure_bf16:
            parts.append("bf16-pure")
        if self.loss != "plain":
            parts.append(f"{self.loss} loss")
        if self.checkpoint_layers:
            parts.append(f"checkpointing {self.checkpoint_layers}/{layers} layers")
        if self.activation_offload:
            parts.append("activations offloaded")
        if self.optimizer_in_backward:
            parts.append("optimizer step in backward")
        return ", ".join(parts) or "no savers"


def chunk_tokens(m: ModelFacts) -> int:
    """Tokens per chunk of the chunked loss: their fp32 logits take CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * m.vocab_size))


def fused_kernels(hw: Hardware) -> list[str]:
    """Installed fused linear-cross-entropy kernels, on NVIDIA GPUs (both packages are Triton kernels)."""
    if hw.accelerator is None or hw.accelerator.vendor != "nvidia":
        return []
    return [name for name, package in FUSED_PACKAGES.items() if importlib.util.find_spec(package) is not None]


def loss_options(config: Config, hw: Hardware, sharding: str | None) -> list[str]:
    """Loss implementations this candidate can run. The fused kernels take the head's whole weight (not under ZeRO-3,
    which partitions it, nor with the head trained next to an adapter) and Liger's serves a summed loss only
    (the section's `summed_loss`: SFT; methods/head.py refuses the rest)."""
    asked = config.train.loss_implementation
    head_trained = "lm_head" in config.adapter.modules_to_save

    def usable(kernel: str) -> bool:
        if sharding == "zero3" or head_trained:
            return False
        return kernel != "liger" or config.method.summed_loss

    if asked in FUSED_PACKAGES:
        return [asked] if usable(asked) else []
    if asked != "auto":
        return [asked]
    fused = [k for k in fused_kernels(hw) if usable(k)]
    return fused[:1] or ["plain", "chunked"]


def checkpoint_options(config: Config, m: ModelFacts) -> list[int]:
    """Numbers of checkpointed layers to try: none, a quarter, half, three quarters, all."""
    t, layers = config.train, m.num_layers
    if t.checkpoint_layers != "auto":
        return [min(t.checkpoint_layers, layers)]
    if t.gradient_checkpointing is True:
        return [layers]
    if t.gradient_checkpointing is False:
        return [0]
    return sorted({0, layers, *(max(1, layers * q // 4) for q in (1, 2, 3))})


def offload_options(config: Config, hw: Hardware) -> list[bool]:
    asked = config.train.activation_offload
    if asked != "auto":
        return [asked]
    return [False] if hw.is_cpu else [False, True]


def step_in_backward_allowed(config: Config, backend: str, world: int) -> bool:
    """One process without clipping: each parameter's update only needs its own gradient (accumulation is checked
    per micro-batch size)."""
    return backend == "single" and world == 1 and config.train.max_grad_norm == 0


def in_backward_options(config: Config, backend: str, world: int) -> list[bool]:
    asked = config.train.optimizer_in_backward
    if asked is True:
        return [True] if step_in_backward_allowed(config, backend, world) else []  # this candidate cannot
    if asked is False:
        return [False]
    return [False, True] if step_in_backward_allowed(config, backend, world) else [False]


def check_in_backward(config: Config, world: int) -> None:
    """A pinned optimizer step in backward on more than one rank: say why it cannot be."""
    if config.train.optimizer_in_backward is True and world > 1:
        raise PlanError(
            f"train.optimizer_in_backward: true needs one process: each parameter is updated before the others' "
            f"gradients exist, so there is nothing to reduce across the {world} ranks first; set "
            "distributed.processes_per_node: 1 and nodes: 1 (or backend: single), or optimizer_in_backward: auto"
        )


def combinations(
    config: Config,
    hw: Hardware,
    m: ModelFacts,
    backend: str,
    world: int,
    pure_bf16: bool,
    sharding: str | None = None,
) -> list[Savers]:
    """Every combination of savers this config allows, cheapest in time first (no savers before any)."""
    out = [
        Savers(pure_bf16, loss, k, off, oib)
        for loss, k, off, oib in product(
            loss_options(config, hw, sharding),
            checkpoint_options(config, m),
            offload_options(config, hw),
            in_backward_options(config, backend, world),
        )
    ]
    return sorted(out, key=lambda v: (v.activation_offload, v.checkpoint_layers, v.loss == "chunked"))
