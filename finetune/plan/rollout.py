"""Where a method's rollouts run (GRPO): the engine that samples, its place on the hardware, its tensor parallelism and
memory share, and the step split between generation, training and weight sync (`Plan.rollout`).

engine          auto: vLLM where there are GPUs, it is installed and it can serve the adapter; else transformers'
                generate on the training model (placement `inline`).
placement       colocated: a vLLM engine in each training process, sharing its GPU; on GPUs it sleeps during the
                backward pass (sleep level 1: weights to host RAM, KV cache freed) unless rollouts are asynchronous.
                server: a pool of GPUs taken from the job (whole nodes across nodes, a power of two of the node's GPUs
                on one node), or a server already running at method.rollout.url. `auto` takes the least estimated
                step time among the placements that fit:
                  colocated        generation + training + sync (each GPU does both, in turn)
                  pool of g GPUs   generation(g) + training(n - g) + sync; asynchronous: max(generation, training)
                                   + sync
tensor_parallel the smallest power of two (dividing the attention and KV heads and the GPUs of a node) at which the
                engine's weights / TP + its KV cache for one rollout / TP + a workspace fit its memory share.
memory_share    colocated: the usable memory less the trainer's resident state (its whole peak when the engine
                stays awake), over the GPU's memory, at most 0.9; a pool GPU: 0.9.
Seconds are per optimizer step: a rollout serves method.num_iterations steps, weights go out every sync_every steps
(plan/cost.py's generation model; comm.py's links; waking a sleeping engine moves its weights over PCIe twice).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace

from finetune.catalog import ModelFacts
from finetune.catalog_layers import LINEAR_ATTENTION
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.comm import INTER_NODE_BPS, INTRA_NODE_BPS
from finetune.plan.cost import generation_seconds
from finetune.plan.memory import GiB
from finetune.plan.plan import Decision, RolloutPlan
from finetune.plan.rollout_options import (
    MAX_SHARE,
    Job,
    Option,
    colocated,
    first,
    fit_trainer,
    layout,
    pool_sizes,
    resident_bytes,
    seconds,
    server,
    sync_seconds,
    tp_options,
)
from finetune.plan.search import Fit, device_capacity
from finetune.plan.topology import EngineShare, Topology, choose_global_batch, choose_precision, choose_topology

CPU_KV_CACHE_GIB = 1.0  # method.rollout.kv_cache_gib: null


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


RAY_MISSING = (
    "method.rollout.placement: ray, but Ray is not installed here (ft train runs the job through it)\n    fix: pip "
    "install 'finetune[ray]' (or pip install 'ray>=2.50'), or set method.rollout.placement: auto"
)


def unservable(adapter, adapter_type: str, train_embeddings: bool = False) -> str:
    """What of the trained model a vLLM engine cannot take from the trainer, in words ('' when nothing): the planner
    then samples with the training model, and an explicit `method.engine: vllm` is refused (`servable`)."""
    if train_embeddings:
        return "embeddings grown for tokens added to the vocabulary (vLLM loads the checkpoint's own)"
    if adapter_type != "full" and adapter.dora:
        return "a DoRA adapter (adapter.dora)"
    if adapter_type != "full" and adapter.modules_to_save:
        return f"modules trained in full (adapter.modules_to_save: {adapter.modules_to_save})"
    return ""


@dataclass(frozen=True)
class Placement:
    """The rollout part of a Plan before the trainer is placed: the trainer's topology takes the rollout's
    `server_gpus` and `share` from it."""

    rollout: RolloutPlan
    decisions: tuple[Decision, ...]
    share: EngineShare = EngineShare()

    def to_plan(self, hw: Hardware, topo: Topology, fit: Fit) -> RolloutPlan:
        """Plan.rollout: what the runtime reads (finetune/rollout/), with the trainer's GPUs and seconds."""
        r = self.rollout
        return replace(
            r,
            train_gpus=0 if hw.is_cpu else topo.world,
            generation_seconds=round(r.generation_seconds, 6),
            training_seconds=round(fit.step_seconds, 6),
            sync_seconds=round(r.sync_seconds, 6),
        )


# ---------------------------------------------------------------- the choice
def choose_rollout(config: Config, hw: Hardware, m: ModelFacts) -> Placement | None:
    """The engine and its placement; None when the method samples nothing."""
    seq = config.data.seq_len
    if not config.method.generation_tokens(seq):
        return None
    choose_global_batch(config, choose_topology(config, hw, []), [])  # the planner's own errors come first
    if config.method.rollout.placement == "ray" and not ray_installed():
        raise PlanError(RAY_MISSING)
    out: list[Decision] = []
    engine = choose_engine(config, hw, out)
    completion = min(config.method.completion_tokens(), seq)
    job = Job(config, hw, m, choose_precision(config, hw, []), seq - completion, completion)
    if engine == "transformers":
        return _inline(job, out)
    if hw.is_cpu:
        return _on_cpu(job, out)
    try:
        return _on_gpus(job, out)
    except EngineDoesNotFit as e:
        if not e.fallback:
            raise
        why = f"vLLM does not fit next to the trainer ({e.need}): the training model samples with generate"
        return _inline(job, [replace(out[0], value="transformers", reason=why)])


class EngineDoesNotFit(PlanError):
    """No placement of the vLLM engine fits, though the trainer alone does."""

    def __init__(self, message: str, need: str, fallback: bool) -> None:
        super().__init__(message)
        self.need, self.fallback = need, fallback  # fallback: nothing pinned the engine, transformers may sample


def choose_engine(config: Config, hw: Hardware, out: list[Decision]) -> str:
    method = config.method
    if method.engine != "auto":
        missing = method.engine == "vllm" and not vllm_installed()
        why = "as set in the config" + (" (vLLM is not installed where this plan was made)" if missing else "")
        out.append(Decision("engine", method.engine, why, "config"))
        return method.engine
    limits = unservable(config.adapter, config.adapter.type)
    if hw.is_cpu:
        engine, why = "transformers", "no GPU: the training model samples with generate (method.engine: vllm runs "
        why += "vLLM's CPU build)"
    elif not vllm_installed():
        engine, why = "transformers", "vLLM is not installed: the training model samples with generate"
    elif limits:
        engine, why = "transformers", f"vLLM cannot serve {limits}: the training model samples with generate"
    else:
        engine = "vllm"
        why = "GPUs and vLLM installed: vLLM samples with a paged KV cache and receives the trainer's weights"
    for asked, needs, instead in (
        (method.rollout.placement == "ray", "placement: ray runs vLLM's servers on the Ray cluster", "placement: auto"),
        (method.rollout.asynchronous, "asynchronous: true needs a vLLM rollout engine", "asynchronous: false"),
    ):
        if engine == "transformers" and asked:
            raise PlanError(
                f"method.rollout.{needs}, but method.engine: auto chose transformers ({why.split(':')[0]}); set "
                f"method.engine: vllm where vLLM is installed, or method.rollout.{instead}"
            )
    out.append(Decision("engine", engine, why))
    return engine


def _inline(job: Job, out: list[Decision]) -> Placement:
    topo, batch = layout(job, 0)
    per_rank = batch // topo.world
    gen = generation_seconds(
        job.m, job.hw, job.precision, job.weight_bytes, job.prompt, job.completion, per_rank, generate=True
    )
    out.append(
        Decision(
            "rollout.placement",
            "inline",
            "transformers: each rank samples its share of the rollout with the training model between steps (no "
            "weights to send)",
        )
    )
    return _placement(job, "transformers", "inline", out, generation_seconds=gen, kv_cache_bytes=job.kv_bytes(per_rank))


def _on_cpu(job: Job, out: list[Decision]) -> Placement:
    """vLLM's CPU build: an engine in each training process, or one server process; no GPU memory to share."""
    r = job.section
    if r.tensor_parallel not in ("auto", 1):
        raise PlanError(
            f"method.rollout.tensor_parallel: {r.tensor_parallel}: on CPU a vLLM engine runs in one process; set it "
            "to 1 or auto"
        )
    dtype = job.precision if job.precision in ("fp32", "fp16") else "bf16"  # the engine's (rollout/factory.py)
    if LINEAR_ATTENTION in job.m.layer_types and dtype != "bf16":
        raise PlanError(  # vLLM 0.32 model_executor/layers/mamba/ops/cpu/gdn_attention.py: the first forward asserts it
            f"method.engine: vllm: on a CPU, vLLM runs the linear-attention (gated delta-net) layers of "
            f"{job.m.name} in bf16 only, and this plan generates in {dtype} (train.precision: "
            f"{job.config.train.precision}); the engine would fail at its first step.\n    fix: set "
            "train.precision: bf16, or method.engine: transformers"
        )
    server = r.url is not None or r.placement in ("server", "ray")
    kv = int((r.kv_cache_gib or CPU_KV_CACHE_GIB) * GiB)
    share = EngineShare(samples=False) if server else EngineShare(samples=False, device_bytes=job.weight_bytes + kv)
    node = job.hw.devices_per_node if r.placement == "ray" and job.hw.nodes > 1 else 0  # the engine's own node
    topo, batch = layout(job, node, share)
    engines = 1 if server else topo.world
    fit = fit_trainer(job, topo, batch)
    gen = generation_seconds(
        job.m, job.hw, job.precision, job.weight_bytes, job.prompt, job.completion, math.ceil(batch / engines)
    )
    where = r.placement if r.placement == "ray" else "server" if server else "colocated"
    why = (
        "one vLLM server process next to the trainer's ranks, which keep all the processes"
        if server
        else "a vLLM engine in each training process (its weights and KV cache in the process's memory)"
    )
    if where == "ray":
        why = _ray_cpu_reason(job, topo, node)
    out.append(Decision("rollout.placement", where, why, "auto" if r.placement == "auto" and not r.url else "config"))
    out.append(
        Decision(
            "rollout.kv_cache",
            f"{kv / GiB:g} GiB",
            "method.rollout.kv_cache_gib (null: 1 GiB): on CPU vLLM's KV cache is set in GiB, not as a memory share",
            "auto" if r.kv_cache_gib is None else "config",
        )
    )
    return _placement(
        job,
        "vllm",
        where,
        out,
        share=share,
        kv_cache_bytes=kv,
        generation_seconds=gen,
        sync_seconds=sync_seconds(job, fit, INTRA_NODE_BPS) if fit else 0.0,
        server_gpus=node,
        engines=1 if where == "ray" else 0,
        engine_nodes=1 if node else 0,
    )


def _ray_cpu_reason(job: Job, topo: Topology, node: int) -> str:
    ranks = f"the trainer's {topo.world} rank{'s' if topo.world > 1 else ''}"
    if node:
        return (
            f"as set in the config: one vLLM server on a node of its own (node {topo.nodes}), {ranks} on node"
            f"{'s 0-' + str(topo.nodes - 1) if topo.nodes > 1 else ' 0'}: Ray actors pinned to their nodes"
        )
    return f"as set in the config: one vLLM server next to {ranks} on node 0: Ray actors pinned to the node"


def _on_gpus(job: Job, out: list[Decision]) -> Placement:
    r = job.section
    if r.url is not None:
        return _external(job, out)
    asked = r.placement if r.placement in ("server", "ray") else "server" if r.gpus != "auto" else r.placement
    if asked in ("server", "ray") and job.hw.world_size == 1:
        raise PlanError(
            f"method.rollout.placement: {asked} needs GPUs of its own for the rollout pool, but this hardware has 1 "
            "GPU; set method.rollout.placement: colocated (or auto), or give method.rollout.url of a vLLM server (ft "
            "rollout-server) running elsewhere"
        )
    options: list[Option] = []
    if asked in ("auto", "colocated"):
        # an asynchronous engine generates while the trainer steps: it cannot sleep
        for sleeps in (False,) if r.asynchronous else (False, True):
            options += first(colocated(job, tp, sleeps) for tp in tp_options(job))
    if asked in ("auto", "server", "ray"):
        for g in pool_sizes(job):
            options += first(server(job, g, tp) for tp in tp_options(job) if g % tp == 0)
    if asked == "ray":  # the same pools, each engine a server started by a Ray actor on the node the plan gives
        options = [replace(o, placement="ray") for o in options]
    if not options:
        return _refuse(job, asked, out)
    best = min(options, key=lambda o: o.step)  # ties: colocated, then the smaller pool
    _record(job, best, options, asked, out)
    return _placement(
        job,
        "vllm",
        best.placement,
        out,
        server_gpus=best.server_gpus,
        tensor_parallel=best.tensor_parallel,
        memory_share=best.memory_share,
        kv_cache_bytes=job.kv_bytes(best.sequences),
        sleep=best.share.sleeps,
        share=best.share,
        generation_seconds=best.seconds[0],
        sync_seconds=best.seconds[2],
        **_ray_nodes(job, best),
    )


def _ray_nodes(job: Job, o: Option) -> dict:
    """Placement ray: the engines, and the nodes given to them whole (across nodes; on one node they share it)."""
    if o.placement != "ray":
        return {}
    return {"engines": o.engines, "engine_nodes": o.server_gpus // job.hw.devices_per_node if job.hw.nodes > 1 else 0}


def _placement(job: Job, engine: str, where: str, out: list[Decision], share=EngineShare(), **values) -> Placement:
    r = job.section
    ahead = r.max_staleness if r.asynchronous else 1
    rollout = RolloutPlan(
        engine, where, sync_every=r.sync_every, asynchronous=r.asynchronous, max_staleness=ahead, url=r.url, **values
    )
    return Placement(rollout, tuple(out), share)


def _external(job: Job, out: list[Decision]) -> Placement:
    """A server at method.rollout.url: ft starts none, the trainer keeps every GPU. Its size is unknown: the estimate
    takes one engine of tensor_parallel GPUs."""
    r = job.section
    tp = 1 if r.tensor_parallel == "auto" else r.tensor_parallel
    topo, batch = layout(job, 0, EngineShare(samples=False))
    fit = fit_trainer(job, topo, batch)
    share_of = MAX_SHARE if r.memory_share == "auto" else r.memory_share
    option = Option("server", 0, tp, share_of, topo.engine, fit, 1, batch, overlap=r.asynchronous) if fit else None
    split = seconds(job, option, INTER_NODE_BPS) if option else (0.0, 0.0, 0.0)
    urls = r.url if isinstance(r.url, str) else ", ".join(r.url)
    out.append(
        Decision(
            "rollout.placement",
            "server",
            f"method.rollout.url: the vLLM server at {urls} samples; ft starts none and the trainer keeps all "
            f"{job.hw.world_size} GPUs (its step estimate assumes one engine of {tp} GPU{'s' if tp > 1 else ''})",
            "config",
        )
    )
    return _placement(
        job,
        "vllm",
        "server",
        out,
        tensor_parallel=tp,
        memory_share=share_of,
        kv_cache_bytes=job.kv_bytes(batch),
        share=topo.engine,
        generation_seconds=split[0],
        sync_seconds=split[2],
    )


# ---------------------------------------------------------------- reasons and refusals
def _describe(o: Option) -> str:
    gen, train, sync = o.seconds
    where = f"a pool of {o.server_gpus} GPU{'s' if o.server_gpus > 1 else ''}"
    if o.placement == "colocated":
        where = "colocated, asleep during the backward pass" if o.share.sleeps else "colocated, awake"
    how = "max(generation, training)" if o.overlap else "generation + training"
    return f"{where}: est. {o.step:.3g} s/step ({how} + sync: {gen:.3g}, {train:.3g}, {sync:.3g})"


def _record(job: Job, best: Option, options: list[Option], asked: str, out: list[Decision]) -> None:
    r, gib = job.section, lambda b: f"{b / GiB:.1f} GiB"
    others = [_describe(o) for o in options if o is not best]
    why = "the least estimated step time: " if asked == "auto" else "as set in the config: "
    why += _describe(best) + (f"; {'; '.join(others)}" if others else "")
    if asked == "auto" and not any(o.placement == "colocated" for o in options):
        why += "; colocated does not fit next to the trainer"
    out.append(Decision("rollout.placement", best.placement, why, _source(asked)))
    if best.placement in ("server", "ray"):
        out.append(
            Decision(
                "rollout.gpus",
                best.server_gpus,
                f"{best.server_gpus} GPUs generate ({best.engines} engine{'s' if best.engines > 1 else ''}), the "
                f"other {job.hw.world_size - best.server_gpus} train",
                _source(r.gpus),
            )
        )
    tp, seqs = best.tensor_parallel, best.sequences
    out.append(
        Decision(
            "rollout.tensor_parallel",
            tp,
            f"the fewest GPUs per engine that hold its weights ({gib(job.weight_bytes / tp)} per GPU) and the KV cache "
            f"of its {seqs} sequences ({gib(job.kv_bytes(seqs) / tp)} per GPU) in its memory share",
            _source(r.tensor_parallel),
        )
    )
    out.append(Decision("rollout.memory_share", best.memory_share, _share_reason(job, best), _source(r.memory_share)))
    if best.placement == "ray":
        out.append(Decision("rollout.nodes", _ray_where(job, best), _ray_why(job, best)))


def _ray_where(job: Job, o: Option) -> str:
    per_node, nodes = job.hw.devices_per_node, job.hw.nodes
    if nodes == 1:
        return (
            f"node 0: GPUs 0-{per_node - o.server_gpus - 1} train, {per_node - o.server_gpus}-{per_node - 1} generate"
        )
    first = nodes - o.server_gpus // per_node
    train = "node 0" if first == 1 else f"nodes 0-{first - 1}"
    engines = f"node {first}" if first == nodes - 1 else f"nodes {first}-{nodes - 1}"
    return f"{train} train, {engines} generate"


def _ray_why(job: Job, o: Option) -> str:
    per = o.engines // max(1, o.server_gpus // job.hw.devices_per_node) if job.hw.nodes > 1 else o.engines
    servers = "one vLLM server per rollout node" if job.hw.nodes > 1 else "one vLLM server"
    return (
        f"{servers} ({per} engine{'s' if per > 1 else ''} of tensor parallel {o.tensor_parallel} each, as vLLM's "
        "data-parallel ranks) and each training rank are Ray actors in one placement group, each bundle pinned to "
        "its node: engines never share a node's GPUs with the trainer across nodes, and tensor parallelism stays "
        "inside a node"
    )


def _share_reason(job: Job, o: Option) -> str:
    total, usable = job.hw.device_memory_bytes / GiB, device_capacity(job.hw) / GiB
    if o.placement in ("server", "ray"):
        return "a pool GPU holds only its engine: vLLM's default 0.9"
    if o.share.sleeps:
        return (
            f"{usable:.1f} GiB usable less the trainer's {o.held / GiB:.1f} GiB resident state, of {total:.1f} GiB "
            f"(at most {MAX_SHARE}): the engine sleeps during the backward pass (level 1: its weights wait in host RAM)"
        )
    why = (
        "asynchronous rollouts keep the engine awake while the trainer steps"
        if job.section.asynchronous
        else "the engine stays awake next to it (no sleep and wake transfers)"
    )
    return (
        f"{usable:.1f} GiB usable less the trainer's whole {o.held / GiB:.1f} GiB peak, of {total:.1f} GiB (at most "
        f"{MAX_SHARE}): {why}"
    )


def _source(asked) -> str:
    return "auto" if asked == "auto" else "config"


def _refuse(job: Job, asked: str, out: list[Decision]) -> Placement:
    """No placement fits. When the trainer alone does not fit either, the planner's own refusal (with its advice)
    says so: this returns a placement without an engine for it to plan. Otherwise the engine is what does not fit."""
    topo, batch = layout(job, 0, EngineShare(samples=False))
    alone = fit_trainer(job, topo, batch)
    if alone is None:
        return _placement(job, "vllm", "colocated", out, share=EngineShare(samples=False))
    r = job.section
    pinned = (("memory_share", r.memory_share), ("tensor_parallel", r.tensor_parallel), ("gpus", r.gpus))
    key = next((k for k, v in pinned if v != "auto"), "placement" if asked != "auto" else None)
    tp = max(tp_options(job))
    sequences = math.ceil(batch / max(1, topo.world // tp))
    need, held = job.need(tp, sequences) / GiB, resident_bytes(alone.estimate) / GiB
    what = f"method.rollout.{key}: {getattr(r, key)}" if key else "method.engine: vllm"
    short = (
        f"at tensor_parallel {tp} it needs {need:.1f} GiB per GPU next to the trainer's {held:.1f} GiB resident "
        f"state, {device_capacity(job.hw) / GiB:.1f} GiB usable"
    )
    raise EngineDoesNotFit(
        f"{what}: the vLLM rollout engine does not fit: {short} (weights, the KV cache of {sequences} sequences of "
        f"{job.prompt + job.completion} tokens, workspace)"
        + ("" if job.hw.world_size > 1 else "; one GPU leaves no room for a separate rollout pool")
        + "; set method.engine: transformers, or lower train.global_batch_size, data.seq_len or "
        "method.max_new_tokens" + (", or leave method.rollout's keys on auto" if key else ""),
        short,
        fallback=key is None and job.config.method.engine == "auto" and not r.asynchronous,
    )
