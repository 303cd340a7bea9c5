"""The trainer's side of a weight update: what a rollout engine receives after the policy changed.

An adapter (LoRA/QLoRA) travels as peft files: rank 0 writes the trained adapter into RUN/rollout/adapter-<version>
(gathered first where it is sharded), and an engine serves it as a new LoRA request on its unchanged base. A model
trained in full travels as tensors, one parameter at a time, each gathered whole where it is sharded (a collective:
every rank iterates together), so no rank ever holds more than one gathered parameter besides its shards; for a vLLM
server that reloads from files (CPU: rollout/server.py), rank 0 writes them into RUN/rollout/weights-<version>, one
safetensors file per decoder layer.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

KEEP_ADAPTERS = 2  # the folder an engine serves now, and the one before (a server may still be reading it)


class Weights:
    """The policy at one version (optimizer steps taken), as a rollout engine takes it."""

    def __init__(self, engine, runtime, folder: Path, version: int, adapter: bool, in_flight=frozenset()):
        self.engine, self.runtime, self.folder, self.version = engine, runtime, Path(folder), version
        self.kind = "adapter" if adapter else "full"
        self.in_flight = frozenset(in_flight)  # older versions that rollouts still generating use (asynchronous)

    def adapter_folder(self) -> Path:
        """Every rank calls this: rank 0 writes the adapter (peft format), the others wait; older versions are
        removed (ft wrote them)."""
        path = self.folder / f"adapter-{self.version:08d}"
        state = self.engine.full_state_dict(trainable_only=True)  # a collective where sharded; None when whole
        if self.runtime.is_main:
            tmp = path.with_name(f".tmp-{path.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self.engine.inner.save_pretrained(str(tmp), **({"state_dict": state} if state is not None else {}))
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
            prune(path, self.in_flight)
        self.runtime.barrier()
        return path

    def checkpoint_folder(self) -> Path:
        """Every rank calls this (each parameter is gathered in turn): rank 0 writes the full weights as safetensors
        files, one per decoder layer (at most one layer in host memory), in the names transformers saves; older
        versions are removed (ft wrote them)."""
        from safetensors.torch import save_file

        path = self.folder / f"weights-{self.version:08d}"
        tmp = path.with_name(f".tmp-{path.name}")
        if self.runtime.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        main = self.runtime.is_main  # the other ranks only take part in gathering each parameter
        on_cpu = ((n, t.detach().to("cpu", copy=True) if main else t) for n, t in self.tensors())
        for index, group in enumerate(layer_groups(on_cpu)):
            if main:
                save_file({n: t.contiguous() for n, t in group}, str(tmp / f"part-{index:05d}.safetensors"))
        if self.runtime.is_main:
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
            prune(path)
        self.runtime.barrier()
        return path

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole tensor) for every parameter, in the names transformers saves; every rank iterates. A tensor is
        valid until the next one is asked for."""
        yield from self.engine.full_parameters()


def prune(path: Path, in_flight=frozenset()) -> None:
    """Of the folders like `path` (adapter-<version>, weights-<version>; ft wrote them), keep `path`, the newest
    older one (an engine may still read it) and the versions rollouts in flight use; a newer one is what a run stopped
    after its last checkpoint left, and goes too (a resumed run sends an older version first)."""
    kind = path.name.rsplit("-", 1)[0]
    older = sorted(p for p in path.parent.glob(f"{kind}-*") if p.name < path.name)
    kept = {f"{kind}-{v:08d}" for v in in_flight}
    for old in [p for p in path.parent.glob(f"{kind}-*") if p.name > path.name] + older[: -(KEEP_ADAPTERS - 1)]:
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)


def layer_groups(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive parameters grouped by decoder layer (`...layers.<i>.`), everything else alone: the unit a server
    receives at once."""
    group, key = [], None
    for name, tensor in named:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        this = ".".join(parts[: index + 1]) if index is not None else name
        if group and this != key:
            yield group
            group = []
        group.append((name, tensor))
        key = this
    if group:
        yield group
