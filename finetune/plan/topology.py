"""Topology, precision and global batch: the choices made before any setup is searched."""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.plan import Decision


@dataclass(frozen=True)
class Topology:
    nodes: int
    processes_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.processes_per_node


def choose_topology(config: Config, hw: Hardware, out: list[Decision]) -> Topology:
    d = config.distributed
    unit = "process" if hw.is_cpu else "GPU"
    if d.backend == "single":
        idle = "" if hw.world_size == 1 else f" ({hw.world_size - 1} of the {hw.world_size} {unit}s stay idle)"
        out.append(
            Decision(
                "world_size",
                1,
                "backend single runs one process" + idle,
                "config",
            )
        )
        return Topology(1, 1)
    nodes = hw.nodes if d.nodes == "auto" else d.nodes
    if nodes > hw.nodes:
        raise PlanError(
            f"distributed.nodes: {nodes} asks for more nodes than the hardware has ({hw.describe()}); set "
            f"distributed.nodes: {hw.nodes} or auto, or plan for the hardware you will run on (--hardware "
            f"{nodes}x{hw.devices_per_node}x...)"
        )
    ppn = hw.devices_per_node if d.processes_per_node == "auto" else d.processes_per_node
    if not hw.is_cpu and ppn > hw.devices_per_node:
        raise PlanError(
            f"distributed.processes_per_node: {ppn} is more than the {hw.devices_per_node} GPUs per node; set it "
            f"to {hw.devices_per_node} or auto"
        )
    source = "auto" if d.nodes == "auto" and d.processes_per_node == "auto" else "config"
    why = f"{nodes} node{'s' if nodes > 1 else ''} × {ppn} {unit}{'s' if ppn > 1 else ''}"
    out.append(
        Decision("world_size", nodes * ppn, why + (" (all the hardware has)" if source == "auto" else ""), source)
    )
    return Topology(nodes, ppn)


def pure_bf16_mode(config: Config, hw: Hardware) -> str:
    """`always` (precision bf16-pure), `fallback` (auto on an accelerator with bf16: only when mixed precision does not
    fit) or `never`."""
    p = config.train.precision
    if p == "bf16-pure":
        return "always"
    return "fallback" if p == "auto" and hw.accelerator is not None and hw.accelerator.bf16 else "never"


def choose_precision(config: Config, hw: Hardware, out: list[Decision]) -> str:
    """The compute precision (bf16-pure computes in bf16; whether the trained state is bf16 too is a saver)."""
    p = config.train.precision
    acc = hw.accelerator
    if p != "auto":
        if acc is not None and p in ("bf16", "bf16-pure") and not acc.bf16:
            raise PlanError(f"train.precision: {p} is not supported by {acc.name}; set train.precision: fp16 (or auto)")
        if p == "bf16-pure":
            out.append(Decision("precision", p, "as set in the config", "config"))
            return "bf16"
        if acc is None and p == "fp16":
            raise PlanError(
                "train.precision: fp16 is not supported for training on CPU; set train.precision: bf16 or fp32 "
                "(or auto)"
            )
        out.append(Decision("precision", p, "as set in the config", "config"))
        return p
    if acc is None:
        out.append(
            Decision(
                "precision",
                "fp32",
                "CPU: fp32 is exact and supported everywhere (set bf16 to use AMX/AVX-512 bf16 units where the "
                "CPU has them)",
            )
        )
        return "fp32"
    if acc.bf16:
        out.append(
            Decision("precision", "bf16", f"{acc.name} supports bf16: half the memory of fp32, no loss scaling needed")
        )
        return "bf16"
    out.append(Decision("precision", "fp16", f"{acc.name} has no bf16; fp16 with dynamic loss scaling"))
    return "fp16"


def choose_global_batch(config: Config, topo: Topology, out: list[Decision]) -> int:
    t, world = config.train, topo.world
    if t.global_batch_tokens is not None:
        seqs = max(world, round(t.global_batch_tokens / config.data.seq_len / world) * world)
        out.append(
            Decision(
                "global_batch_size",
                seqs,
                f"{t.global_batch_tokens} tokens / seq_len {config.data.seq_len}, rounded to a multiple of world "
                f"size {world}: {seqs * config.data.seq_len} tokens per step",
            )
        )
        return seqs
    if t.global_batch_size % world:
        lower, upper = (t.global_batch_size // world) * world, (t.global_batch_size // world + 1) * world
        options = " or ".join(str(n) for n in (lower, upper) if n)
        raise PlanError(
            f"train.global_batch_size: {t.global_batch_size} sequences cannot be split evenly over {world} "
            f"ranks; set it to {options}, or change distributed.processes_per_node / nodes"
        )
    out.append(
        Decision(
            "global_batch_size",
            t.global_batch_size,
            f"{t.global_batch_size // world} sequences per rank × {world} ranks",
            "config" if t.explicit("global_batch_size") else "auto",
        )
    )
    return t.global_batch_size


def with_hardware(hw: Hardware, nodes: int | None = None, devices_per_node: int | None = None) -> Hardware:
    """The same hardware with another node or device count (for 'what would fit' advice)."""
    return replace(hw, nodes=nodes or hw.nodes, devices_per_node=devices_per_node or hw.devices_per_node)
