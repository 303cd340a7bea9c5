"""The placements of a rollout engine on GPUs, each fitted: the trainer planned on what the engine leaves it
(plan/search.py), and the estimated seconds of its step (plan/cost.py). plan/rollout.py chooses and gives reasons."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from finetune.catalog import ModelFacts
from finetune.config.methods import RolloutSection
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.comm import INTER_NODE_BPS, INTRA_NODE_BPS
from finetune.plan.cost import PCIE_BPS, generation_seconds
from finetune.plan.memory import (
    CONTEXT,
    DTYPE_BYTES,
    FRAGMENTATION,
    LOADING,
    RESERVE,
    ROLLOUT,
    TRANSIENT,
    Estimate,
    GiB,
    kv_cache_bytes,
)
from finetune.plan.search import Fit, device_capacity, search
from finetune.plan.topology import EngineShare, Topology, choose_global_batch, choose_topology

MAX_SHARE = 0.9  # of a GPU's memory given to vLLM at most (vLLM's own default gpu_memory_utilization)
ENGINE_WORKSPACE = 1 * GiB  # vLLM's activations, sampler and graphs beyond its weights and KV cache
POWERS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Job:
    """What a placement depends on, read once from the config."""

    config: Config
    hw: Hardware
    m: ModelFacts
    precision: str
    prompt: int  # tokens of a prompt at most (data.seq_len less the completion)
    completion: int  # tokens generated per sequence at most

    @property
    def section(self) -> RolloutSection:
        return self.config.method.rollout

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def weight_bytes(self) -> int:
        """The engine's copy of the model: the base in the compute dtype (an adapter rides along as a LoRA request)."""
        return self.element_bytes * self.m.num_params

    def kv_bytes(self, sequences: int) -> int:
        return int(kv_cache_bytes(self.m, self.element_bytes, self.prompt + self.completion, sequences))

    def need(self, tensor_parallel: int, sequences: int) -> int:
        """An engine's memory per GPU: weights and KV cache for one rollout split over its GPUs, fp32 logits of the
        batch, and a workspace."""
        logits = 4 * sequences * self.m.vocab_size
        return int((self.weight_bytes + self.kv_bytes(sequences) + logits) / tensor_parallel + ENGINE_WORKSPACE)


@dataclass(frozen=True)
class Option:
    """One placement that fits, with the trainer planned next to it and its estimated seconds per step."""

    placement: str
    server_gpus: int
    tensor_parallel: int
    memory_share: float
    share: EngineShare  # what the engine takes on each trainer device
    fit: Fit
    engines: int
    sequences: int  # per engine and rollout
    held: int = 0  # colocated: the trainer's bytes per GPU next to the engine (resident state, or its whole peak)
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)  # generation, training, sync per optimizer step
    overlap: bool = False  # a pool generating asynchronously: the next rollout while the trainer steps

    @property
    def step(self) -> float:
        gen, train, sync = self.seconds
        return (max(gen, train) if self.overlap else gen + train) + sync


# ---------------------------------------------------------------- the options on GPUs
def first(options) -> list[Option]:
    """The first option that fits (the smallest tensor parallelism), as a list of zero or one."""
    return next(([o] for o in options if o is not None), [])


def tp_options(job: Job) -> list[int]:
    m, per_node, asked = job.m, job.hw.devices_per_node, job.section.tensor_parallel
    valid = [
        t
        for t in POWERS
        if t <= per_node and per_node % t == 0 and m.num_attention_heads % t == 0 and m.num_kv_heads % t == 0
    ]
    if asked == "auto":
        return valid
    if asked > per_node:
        raise PlanError(
            f"method.rollout.tensor_parallel: {asked} is more than the {per_node} GPUs of a node (vLLM's tensor "
            f"parallelism stays inside a node); set it to one of {valid} or auto"
        )
    if m.num_attention_heads % asked or m.num_kv_heads % asked or per_node % asked:
        raise PlanError(
            f"method.rollout.tensor_parallel: {asked} does not divide {m.name}'s {m.num_attention_heads} attention "
            f"heads, its {m.num_kv_heads} KV heads and the {per_node} GPUs of a node; set it to one of {valid} or auto"
        )
    return [asked]


def pool_sizes(job: Job) -> list[int]:
    hw, asked = job.hw, job.section.gpus
    per_node = hw.devices_per_node
    if asked == "auto":
        if hw.nodes > 1:
            return [k * per_node for k in range(1, hw.nodes)]
        return [g for g in POWERS if g < per_node]
    if asked >= hw.world_size:
        raise PlanError(
            f"method.rollout.gpus: {asked} leaves no GPU to the trainer ({hw.world_size} in all); set it below "
            f"{hw.world_size}, or auto"
        )
    if hw.nodes > 1 and asked % per_node:
        raise PlanError(
            f"method.rollout.gpus: {asked} is not a whole number of nodes: across nodes the rollout pool takes whole "
            f"nodes of {per_node} GPUs; set it to a multiple of {per_node}, or auto"
        )
    return [asked]


def layout(job: Job, rollout_gpus: int, share: EngineShare = EngineShare()) -> tuple[Topology, int]:
    topo = choose_topology(job.config, job.hw, [], rollout_gpus, share)
    return topo, choose_global_batch(job.config, topo, [])


def fit_trainer(job: Job, topo: Topology, batch: int) -> Fit | None:
    try:
        return search(job.config, job.hw, job.m, topo, job.precision, batch).chosen
    except PlanError:
        return None


def colocated(job: Job, tp: int, sleeps: bool) -> Option | None:
    """An engine of `tp` GPUs for every `tp` training ranks, sharing their GPUs: awake all along next to the trainer's
    whole peak, or asleep during the backward pass next to its resident state only (waking costs host transfers)."""
    topo, batch = layout(job, 0)
    if topo.world % tp:
        return None
    engines = topo.world // tp
    sequences = math.ceil(batch / engines)
    need, total, asked = job.need(tp, sequences), job.hw.device_memory_bytes, job.section.memory_share
    budget = need if asked == "auto" else int(asked * total)
    if need > (MAX_SHARE if asked == "auto" else asked) * total:
        return None
    share = EngineShare(False, budget, sleeps, job.weight_bytes // tp if sleeps else 0)
    fit = fit_trainer(job, replace(topo, engine=share), batch)
    if fit is None:
        return None
    held = resident_bytes(fit.estimate) if sleeps else training_peak(fit.estimate)
    share_of = asked if asked != "auto" else min(MAX_SHARE, (device_capacity(job.hw) - held) // (total / 100) / 100)
    if share_of * total < need:
        return None
    share = replace(share, device_bytes=int(share_of * total))
    option = Option("colocated", 0, tp, share_of, share, fit, engines, sequences, held)
    return replace(option, seconds=seconds(job, option, INTRA_NODE_BPS))


def server(job: Job, g: int, tp: int) -> Option | None:
    """A pool of `g` GPUs running g / tp engines; the trainer on the rest."""
    try:
        topo, batch = layout(job, g, EngineShare(samples=False))
    except PlanError:
        return None
    engines = g // tp
    sequences = math.ceil(batch / engines)
    share_of = MAX_SHARE if job.section.memory_share == "auto" else job.section.memory_share
    if job.need(tp, sequences) > share_of * job.hw.device_memory_bytes:
        return None
    fit = fit_trainer(job, topo, batch)
    if fit is None:
        return None
    option = Option("server", g, tp, share_of, topo.engine, fit, engines, sequences, overlap=job.section.asynchronous)
    return replace(option, seconds=seconds(job, option, INTER_NODE_BPS if job.hw.nodes > 1 else INTRA_NODE_BPS))


def resident_bytes(est: Estimate) -> int:
    """What a rank holds between the phases of a step (weights, gradients, optimizer states, with their allocator
    reserve and the CUDA context): no activations, logits, KV cache or rollout engine."""
    skip = (*TRANSIENT, LOADING, RESERVE, CONTEXT, ROLLOUT)
    state = sum(v for k, v in est.device.items() if k not in skip)
    return int(state * (1 + FRAGMENTATION) if CONTEXT in est.device else state) + est.device.get(CONTEXT, 0)


def training_peak(est: Estimate) -> int:
    """The trainer's own peak per device, without a rollout engine."""
    return sum(v for k, v in est.device.items() if k not in (LOADING, ROLLOUT))


# ---------------------------------------------------------------- seconds per optimizer step
def seconds(job: Job, o: Option, link_bps: float) -> tuple[float, float, float]:
    """(generation, training, sync) per optimizer step."""
    m, iterations = job.m, job.config.method.num_iterations
    gen = generation_seconds(
        m, job.hw, job.precision, job.weight_bytes, job.prompt, job.completion, o.sequences, o.tensor_parallel
    )
    if o.share.sleeps:  # woken from host RAM before the rollout, put back after it
        gen += 2 * job.weight_bytes / o.tensor_parallel / PCIE_BPS
    return gen / iterations, o.fit.step_seconds, sync_seconds(job, o.fit, link_bps)


def sync_seconds(job: Job, fit: Fit, link_bps: float) -> float:
    """The trained weights sent to the engine (an adapter, or the whole model), per optimizer step."""
    trained = job.m.num_params if fit.candidate.adapter == "full" else fit.estimate.trainable_params
    return job.element_bytes * trained / link_bps / job.section.sync_every
