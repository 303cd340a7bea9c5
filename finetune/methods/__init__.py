"""Training methods: each supplies the micro-batches of a step and the loss of a micro-batch.

A method is a module of this package whose class is decorated with `@register("name")`, plus its section in
`finetune.config.methods` (its keys, and what the checks and the planner need to know about it). `build` finds
the class by `method.name` (importing the package's modules on first use, so a new module needs no edit
elsewhere) and lets it build itself, once the backend has wrapped the model, from its own section and a `Context`.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from finetune.data.tokenize import pad_id
from finetune.errors import FtError

if TYPE_CHECKING:
    import torch

    from finetune.plan.plan import Plan


class Method(Protocol):
    """What the training loop asks of a method; it never asks which method runs."""

    name: str
    validates: bool  # it has a validation loss: data.validation is evaluated with `loss`

    @classmethod
    def create(cls, section, context: Context) -> Method:
        """The method for its config section, built from what the context offers."""
        ...

    def micro_batches(self, dataset, rows: list[int]) -> list[dict]:
        """The micro-batches of one step's rows (dataset indices) on this rank."""
        ...

    def tokens(self, batch: dict) -> int:
        """What the step's loss is normalised by, counted in one micro-batch (summed over the step and ranks)."""
        ...

    def loss(self, model, batch: dict, normaliser: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss divided by `normaliser`, and metrics to log."""
        ...


@dataclass(frozen=True)
class Context:
    """What a method may build itself from, besides its own section."""

    plan: Plan
    tokenizer: Any
    pad_id: int
    attn: str  # the attention implementation the model runs with
    engine: Any  # the wrapped model (distributed/engine.py)
    device: Any
    runtime: Any  # rank and world size (distributed/runtime.py)
    autocast: Callable[[], Any]  # a context manager for forward passes in the plan's precision
    dataset: Any  # the prepared training rows
    frozen_copy: Callable[[], Any]  # loads a frozen copy of the starting model (for plan.reference == "copy")
    model: Any = None  # the model section (where the weights come from: a rollout engine loads them too)
    adapter: Any = None  # the adapter section
    folder: Any = None  # the run folder (a method's own files go in a subfolder it owns)
    seed: int = 0  # train.seed
    stream: Any = None  # the data stream (data/stream.py): a method that prepares a batch ahead peeks at it
    validation: Any = None  # the prepared held-out rows (data.validation), where the method validates
    processor: Any = None  # a vision-language model's processor: the pixels of a batch's images (finetune/vision.py)


_REGISTRY: dict[str, type] = {}
_discovered = False


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make the class the method `name` (the value of `method.name` in a job file)."""

    def add(cls: type) -> type:
        known = _REGISTRY.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"two methods are registered as {name!r}: {known.__qualname__} and {cls.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def method_class(name: str) -> type[Method]:
    """The class registered as `name`, importing this package's modules the first time a name is not known."""
    global _discovered
    if name not in _REGISTRY and not _discovered:
        for module in pkgutil.iter_modules(__path__, __name__ + "."):
            importlib.import_module(module.name)  # method modules register themselves as they are imported
        _discovered = True
    if name not in _REGISTRY:
        raise FtError(
            f"method.name: no method {name!r} is registered (known: {', '.join(sorted(_REGISTRY))}); set "
            f"method.name to one of them, or add a module to finetune/methods/ with a class decorated "
            f'@register("{name}")'
        )
    return _REGISTRY[name]


def build(config, plan, prepared, attn: str, engine, device, runtime, autocast, stream=None) -> Method:
    """The configured method, built by its own class from its section and what the job has made so far."""

    def frozen_copy():
        from finetune.distributed.engine import ModelSpec, create_reference

        deepspeed = getattr(engine, "config", None)  # a ZeroEngine's: the reference is partitioned like the policy
        return create_reference(ModelSpec(config, plan, prepared.tokenizer, attn, device, deepspeed))

    context = Context(
        plan=plan,
        tokenizer=prepared.tokenizer,
        pad_id=pad_id(prepared.tokenizer),
        attn=attn,
        engine=engine,
        device=device,
        runtime=runtime,
        autocast=autocast,
        dataset=prepared.train,
        validation=getattr(prepared, "validation", None) if config.method.validates else None,
        frozen_copy=frozen_copy,
        model=config.model,
        adapter=config.adapter,
        folder=Path(config.output.dir).expanduser(),
        seed=config.train.seed,
        stream=stream,
        processor=getattr(prepared, "processor", None),
    )
    return method_class(config.method.name).create(config.method, context)


def pixels(context: Context):
    """What a method adds to a vision-language job's micro-batches (finetune.vision.Pixels: the images' pixel inputs in
    the dtype the model loads in), or None where the job trains no images."""
    if not getattr(context.plan, "vision", False) or context.processor is None:
        return None
    from finetune.models import load_dtype, torch_dtype
    from finetune.vision import Pixels

    return Pixels(context.processor, torch_dtype(load_dtype(context.model, context.plan)) if context.model else None)
