"""Expert parallelism (distributed.expert_parallel): whether to split a mixture-of-experts model's routed experts over
data-parallel ranks, with the memory and traffic it changes.

Under FSDP2 alone every rank all-gathers each MoE layer's experts whole, forward and backward, and reduce-scatters
their gradients: the experts dominate an MoE layer, so they dominate both the gathered-layer peak and the bytes moved.
Split over ep ranks (distributed/ep.py), a rank gathers only its 1/ep of the experts, over the world / ep ranks that
hold the same ones, and instead sends its routed tokens' hidden states to the experts' ranks and gets their outputs
back: per MoE layer and micro-batch, two all-to-alls of t·k·h values forward, two backward, two more per recomputed
layer (plan/comm.py `expert_parallel_traffic`; memory: plan/memory.py `expert_parallel_bytes`).

`auto` chooses it after the search (the setup is FSDP2 on GPUs, a 16-bit base, experts trained or frozen but not
adapted): the degree, among the powers of two dividing a node's processes (the all-to-all stays in a node) and the
experts, whose step moves the fewest seconds of communication, if that is fewer than FSDP2 alone by PAYS; memory
always falls with it. An explicit degree is checked by config/parallel_checks.py (the rules live there, without
torch) and, where the config leaves backend, quantization and sharding to `auto`, the search is confined to what it
runs under (`confined`).
"""

from __future__ import annotations

from dataclasses import replace

from finetune.catalog import ModelFacts
from finetune.config.moe_checks import reaches_experts
from finetune.config.parallel_checks import expert_parallel_problems
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan import parallel
from finetune.plan.comm import Links, collective_seconds
from finetune.plan.memory import GiB, Setup, estimate
from finetune.plan.plan import Decision
from finetune.plan.pricing import priced, traffic
from finetune.plan.topology import Topology

FIELD = "expert_parallel"
PAYS = 1.05  # expert parallelism must cut the step's communication seconds by this factor to be chosen


def confined(config: Config, topo: Topology, m: ModelFacts) -> Config:
    """The config as planned under an explicit degree: FSDP2, full_shard and a 16-bit base where they are `auto` (the
    setups expert parallelism runs under); PlanError, before the search, for what the config alone makes impossible.
    The config itself is never changed."""
    ep = parallel.asked(config.distributed.expert_parallel) or 1
    if ep == 1:
        return config
    d, q = config.distributed, config.quantization
    pinned = {k: v for k, v in (("backend", "fsdp"), ("sharding", "full_shard")) if getattr(d, k) == "auto"}
    update = {"distributed": d.model_copy(update=pinned)}
    if q.type == "auto" and config.adapter.type != "qlora":
        update["quantization"] = q.model_copy(update={"type": "none"})
    planned = config.model_copy(update=update)
    wrong = problems(planned, topo, m, ep)
    if wrong:
        raise PlanError("\n".join(wrong))
    return planned


def problems(config: Config, topo: Topology, m: ModelFacts, ep: int, fit=None) -> list[str]:
    """Why degree `ep` cannot run this job (config/parallel_checks.py): with the chosen setup `fit`, or (None) what
    the config alone decides."""
    d, a = config.distributed, config.adapter
    if fit is not None:
        c = fit.candidate
        setup = dict(backend=c.backend, quantization=c.quantization, tensor_parallel=c.tp, context_parallel=c.cp)
        setup.update(sharding=c.sharding, offload=c.offload, lora_on_experts=c.adapter != "full" and reaches_experts(a))
    else:
        quantization = "nf4" if a.type == "qlora" else config.quantization.type
        setup = dict(backend=d.backend, quantization="none" if quantization == "auto" else quantization)
        setup.update(tensor_parallel=parallel.asked(d.tensor_parallel) or 1)
        setup.update(context_parallel=parallel.asked(d.context_parallel) or 1, sharding=d.sharding, offload=d.offload)
        setup.update(lora_on_experts=a.type in ("lora", "qlora") and reaches_experts(a))
    samples = bool(config.method.generation_tokens(config.data.seq_len))
    return expert_parallel_problems(m, ep, world_size=topo.world, samples=samples, **setup)


def choose(config: Config, hw: Hardware, topo: Topology, m: ModelFacts, fit, s: Setup, speeds: Links, out) -> int:
    """The plan's expert-parallel degree, its Decision appended to `out`; PlanError for an explicit degree that
    cannot run."""
    explicit = parallel.asked(config.distributed.expert_parallel)
    if explicit is None:
        ep, why = _auto(config, hw, topo, m, fit, s, speeds)
        out.append(Decision(FIELD, ep, why))
        return ep
    wrong = problems(config, topo, m, explicit, fit)
    if wrong:
        raise PlanError("\n".join(wrong))
    why = "as set in the config" + (f": {figures(fit, m, s, topo, speeds, explicit)}" if explicit > 1 else "")
    out.append(Decision(FIELD, explicit, why, "config"))
    return explicit


def _auto(config: Config, hw: Hardware, topo: Topology, m: ModelFacts, fit, s: Setup, speeds: Links):
    """(degree, reason) of `auto`: the degree that communicates least, where it beats FSDP2 alone by PAYS."""
    blocker = _blocker(config, hw, topo, m, fit)
    if blocker:
        return 1, blocker
    degrees = _degrees(topo, m)
    options = [d for d in degrees if not problems(config, topo, m, d, fit)]
    if not options:
        if degrees:
            return 1, problems(config, topo, m, degrees[0], fit)[0]
        return 1, (
            f"no power of two divides both a node's {topo.processes_per_node} processes and the {m.num_experts} "
            "experts per layer"
        )
    best = min(options, key=lambda d: _comm_seconds(fit, m, s, topo, speeds, d))
    said = figures(fit, m, s, topo, speeds, best)
    if _comm_seconds(fit, m, s, topo, speeds, best) * PAYS > _comm_seconds(fit, m, s, topo, speeds, 1):
        return 1, f"FSDP2 alone communicates less: at {best}, {said}"
    return best, f"it communicates less than FSDP2 alone: {said}"


def _blocker(config: Config, hw: Hardware, topo: Topology, m: ModelFacts, fit) -> str:
    """Why `auto` does not consider expert parallelism ("" when it does)."""
    c = fit.candidate
    if not m.is_moe:
        return "a dense model: no routed experts to split"
    if topo.world == 1:
        return "one rank: nothing to split the experts over"
    if hw.is_cpu:
        return "CPU: auto tries expert parallelism on GPUs only (set distributed.expert_parallel to split the experts)"
    if c.backend != "fsdp":
        return f"backend {c.backend}: expert parallelism composes with FSDP2 only"
    if c.adapter != "full" and reaches_experts(config.adapter):
        return (
            "the LoRA adapter reaches the routed experts (adapter.target_modules), whose adapters expert parallelism "
            "cannot split; adapt the attention only ([q_proj, k_proj, v_proj, o_proj]) to split the frozen experts"
        )
    return ""


def _degrees(topo: Topology, m: ModelFacts) -> list[int]:
    """Powers of two above 1 dividing a node's processes, the world and the experts."""
    ppn = topo.processes_per_node
    return [d for d in (2, 4, 8, 16, 32, 64) if ppn % d == 0 and topo.world % d == 0 and m.num_experts % d == 0]


def _comm_seconds(fit, m: ModelFacts, s: Setup, topo: Topology, speeds: Links, ep: int) -> float:
    sent = _traffic(fit, m, s, topo, ep)
    return sum(collective_seconds(sent, topo.nodes, s.sharding, topo.processes_per_node, 1, speeds).values())


def _traffic(fit, m: ModelFacts, s: Setup, topo: Topology, ep: int) -> dict[str, float]:
    """The step's bytes per rank by collective at degree `ep` (plan/pricing.py `traffic` counts it)."""
    return traffic(fit, topo, m, replace(s, expert_parallel=ep))


def figures(fit, m: ModelFacts, s: Setup, topo: Topology, speeds: Links, ep: int) -> str:
    """What degree `ep` changes, in words: the peak memory per device and the bytes moved per step and rank."""
    before, after = (estimate(m, replace(s, expert_parallel=d)) for d in (1, ep))
    moved = [sum(_traffic(fit, m, s, topo, d).values()) for d in (1, ep)]
    times = [_comm_seconds(fit, m, s, topo, speeds, d) for d in (1, ep)]
    return (
        f"{m.num_experts} experts per layer over {ep} ranks ({m.num_experts // ep} each): each rank's peak memory "
        f"changes by {_size(after.device_bytes - before.device_bytes, signed=True)} (it gathers only its own experts, "
        f"and holds the tokens in flight), and per step and rank {_size(moved[0])} of FSDP2 traffic (est. "
        f"{times[0]:.3g} s) become {_size(moved[1])} with the routed tokens' all-to-all (est. {times[1]:.3g} s)"
    )


def _size(n: float, signed: bool = False) -> str:
    unit, scale = ("GiB", GiB) if abs(n) >= GiB / 10 else ("MiB", 2**20)
    return f"{n / scale:{'+' if signed else ''}.2f} {unit}"


def apply(config: Config, hw: Hardware, topo: Topology, m: ModelFacts, fit, s: Setup, speeds: Links, out):
    """(the fit, the expert-parallel degree): `choose`'s degree, and the fit's memory and step time under it."""
    ep = choose(config, hw, topo, m, fit, s, speeds, out)
    if ep > 1 and parallel.asked(config.distributed.expert_parallel):
        _confinement_reasons(config, ep, out)
    if ep == 1:
        return fit, 1
    s = replace(s, expert_parallel=ep)
    return priced(replace(fit, estimate=estimate(m, s, topo.processes_per_node)), topo, m, s, hw, speeds), ep


def _confinement_reasons(config: Config, ep: int, out: list) -> None:
    """The reasons of the `auto` choices an explicit degree confined (see `confined`)."""
    pinned = {"backend", "sharding", "quantization"}
    why = f"distributed.expert_parallel: {ep} runs under FSDP2 (full_shard) with a 16-bit base"
    out[:] = [replace(d, reason=why) if d.field in pinned and d.source == "auto" else d for d in out]
