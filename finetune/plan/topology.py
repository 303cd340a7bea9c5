"""Topology, precision and global batch: the choices made before any setup is searched."""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.plan import Decision


@dataclass(frozen=True)
class EngineShare:
    """What a rollout engine other than the training model takes on each trainer device (plan/rollout.py)."""

    samples: bool = True  # the training model samples itself (transformers' generate): its KV cache is the trainer's
    device_bytes: int = 0  # a colocated engine's memory on the device while it is awake
    sleeps: bool = False  # asleep during the backward pass: counted against the trainer's resident state only
    host_bytes: int = 0  # per process: the engine's weights kept in host RAM while it sleeps


@dataclass(frozen=True)
class Topology:
    nodes: int
    processes_per_node: int
    rollout_gpus: int = 0  # GPUs taken from the hardware for a rollout server pool (the trainer runs on the rest)
    engine: EngineShare = EngineShare()

    @property
    def world(self) -> int:
        return self.nodes * self.processes_per_node


def trainer_hardware(hw: Hardware, rollout_gpus: int) -> Hardware:
    """The hardware left to the trainer once a rollout pool of `rollout_gpus` GPUs is taken: whole nodes across
    nodes, GPUs of the one node otherwise (plan/rollout.py only proposes such pools)."""
    if not rollout_gpus:
        return hw
    if hw.nodes > 1:
        return with_hardware(hw, nodes=hw.nodes - rollout_gpus // hw.devices_per_node)
    return with_hardware(hw, devices_per_node=hw.devices_per_node - rollout_gpus)


def choose_topology(
    config: Config, hw: Hardware, out: list[Decision], rollout_gpus: int = 0, engine: EngineShare = EngineShare()
) -> Topology:
    """Nodes and processes of the trainer: all the hardware has, less a rollout pool's `rollout_gpus`."""
    try:
        topo = _choose_topology(config, trainer_hardware(hw, rollout_gpus), out)
    except PlanError as e:
        if not rollout_gpus:
            raise
        raise PlanError(
            f"{e} (the trainer gets the {hw.world_size - rollout_gpus} GPUs left after the rollout pool's "
            f"{rollout_gpus}: see method.rollout.placement and method.rollout.gpus)"
        ) from e
    if rollout_gpus:
        last = out[-1] if out else None
        if last is not None and last.field == "world_size":
            units = "processes" if hw.is_cpu else "GPUs"  # on CPU nodes: placement ray's node for the server
            pool = f" (the {hw.world_size} {units} less the rollout pool's {rollout_gpus})"
            out[-1] = replace(last, reason=last.reason.replace(" (all the hardware has)", "") + pool)
    return replace(topo, rollout_gpus=rollout_gpus, engine=engine)


def _choose_topology(config: Config, hw: Hardware, out: list[Decision]) -> Topology:
    d = config.distributed
    unit = "process" if hw.is_cpu else "GPU"
    if d.backend == "single":
        idle = "" if hw.world_size == 1 else f" ({hw.world_size - 1} of the {hw.world_size} {unit}s stay idle)"
        out.append(Decision("world_size", 1, "backend single runs one process" + idle, "config"))
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
    units = "processes" if hw.is_cpu else "GPUs"
    why = f"{nodes} node{'s' if nodes > 1 else ''} × {ppn} {units if ppn > 1 else unit}"
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
        if acc is None and p == "fp16":
            raise PlanError(
                "train.precision: fp16 is not supported for training on CPU; set train.precision: bf16 or fp32 "
                "(or auto)"
            )
        out.append(Decision("precision", p, "as set in the config", "config"))
        return "bf16" if p == "bf16-pure" else p
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


def choose_global_batch(config: Config, topo: Topology, out: list[Decision], data_parallel: int | None = None) -> int:
    """Sequences per optimizer step: split evenly over the data-parallel ranks (the world, unless the config fixes
    tensor- or context-parallel degrees: then world / (tp x cp); see plan/parallel.py)."""
    t, world = config.train, data_parallel or topo.world
    what = "ranks" if world == topo.world else "data-parallel ranks"
    if t.global_batch_tokens is not None:
        seqs = max(world, round(t.global_batch_tokens / config.data.seq_len / world) * world)
        out.append(
            Decision(
                "global_batch_size",
                seqs,
                f"{t.global_batch_tokens} tokens / seq_len {config.data.seq_len}, rounded to a multiple of "
                f"{'world size' if what == 'ranks' else 'the data-parallel ranks'} {world}: "
                f"{seqs * config.data.seq_len} tokens per step",
            )
        )
        return seqs
    if t.global_batch_size % world:
        lower, upper = (t.global_batch_size // world) * world, (t.global_batch_size // world + 1) * world
        options = " or ".join(str(n) for n in (lower, upper) if n)
        raise PlanError(
            f"train.global_batch_size: {t.global_batch_size} sequences cannot be split evenly over {world} "
            f"{what}; set it to {options}, or change distributed.processes_per_node / nodes"
        )
    out.append(
        Decision(
            "global_batch_size",
            t.global_batch_size,
            f"{t.global_batch_size // world} sequences per {what[:-1]} × {world} {what}",
            "config" if t.explicit("global_batch_size") else "auto",
        )
    )
    return t.global_batch_size


def with_hardware(hw: Hardware, nodes: int | None = None, devices_per_node: int | None = None) -> Hardware:
    """The same hardware with another node or device count (for 'what would fit' advice)."""
    return replace(hw, nodes=nodes or hw.nodes, devices_per_node=devices_per_node or hw.devices_per_node)
