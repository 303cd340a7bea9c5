"""Tensor- and context-parallel degrees: the rules each must satisfy, and the degrees the search tries.

Ranks are laid out data x context x tensor, tensor innermost (finetune/distributed/mesh.py): a tensor-parallel group is
consecutive ranks of one node. FSDP2 shards the rest over the data- and context-parallel ranks; the data-parallel
degree dp = world / (tp x cp) is what the global batch is split over.

Tensor parallelism (distributed.tensor_parallel) splits each decoder layer's attention and MLP over tp GPUs of one
node: it pays where a layer's weights or activations do not fit otherwise, or where FSDP's all-gathers cross slow
inter-node links (each rank then gathers 1/tp of every layer). Its per-layer collectives sit between the matmuls, so
it never spans nodes. Context parallelism (distributed.context_parallel) splits each sequence over cp ranks: it pays
where one sequence's activations dominate memory (long sequences). `auto` tries both on GPUs only; the search
(plan/search.py) keeps one where it is the fastest setup that fits by more than PAYS, or the only one.

The rules: tensor parallelism's layout and divisibility come from finetune/config/parallel_checks.py; the config's
(backend, sharding, offload, quantization, DoRA) and context parallelism's (GPUs, method, packing, attention: the
config's and the kernel the planner chooses for the model class, sequence divisible by 2 x cp) mirror
finetune/distributed/cp.py's `check` without importing torch. The planner runs both under FSDP2 only (cp.py
would also run under DDP; the planner does not offer it).
"""

from __future__ import annotations

from finetune.catalog import ModelFacts
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.attention import ring_problem
from finetune.plan.topology import Topology

CP_MIN_SEQ = 16384  # auto tries context parallelism from this many tokens per sequence: below, activations are small
PAYS = 1.05  # a tensor- or context-parallel setup must be this much faster than the best without to be chosen
TP_BACKENDS = ("auto", "fsdp")
TP_SHARDINGS = ("auto", "full_shard", "shard_grad_op")  # FSDP2 fully_shard over the dp x cp ranks


def asked(value) -> int | None:
    return None if value == "auto" else int(value)


def _model_problems(m: ModelFacts, tp: int, ppn: int) -> list[str]:
    """What a tp-way split of this model's layers on nodes of `ppn` processes needs: finetune/distributed/tp.py's own
    rules (heads, KV heads and MLP width divisible by tp, a layer layout its plan covers, tp dividing a node)."""
    from finetune.config.parallel_checks import tensor_parallel_problems

    return tensor_parallel_problems(m, tp, backend="fsdp", processes_per_node=ppn)


def tp_config_problems(config: Config) -> list[str]:
    """What the config allows of tensor parallelism, whatever the degree."""
    d, q = config.distributed, config.quantization.type
    out = []
    if d.backend not in TP_BACKENDS:
        out.append(f"backend {d.backend}: tensor parallelism composes with FSDP2 only (set distributed.backend: fsdp)")
    if d.sharding not in TP_SHARDINGS:
        out.append(f"sharding {d.sharding}: FSDP2 shards over the data-parallel ranks (set sharding: full_shard)")
    if d.offload not in ("auto", "none"):
        out.append(f"offload {d.offload}: tensor-parallel layers stay on their GPUs (set offload: none)")
    if q in ("nf4", "int8") or config.adapter.type == "qlora":
        out.append("a 4/8-bit base: quantized weights are not split by tensor parallelism (use adapter: lora)")
    if config.adapter.dora:
        out.append("DoRA: its magnitude vectors are not split by tensor parallelism (set adapter.dora: false)")
    return out


def tp_problems(config: Config, topo: Topology, m: ModelFacts, tp: int) -> list[str]:
    """Why `tp` cannot run, each naming the constraint and the fix; empty when it can."""
    if tp == 1:
        return []
    out = [f"distributed.tensor_parallel: {tp}: {p}; or set tensor_parallel: auto" for p in tp_config_problems(config)]
    ppn = topo.processes_per_node
    if tp > ppn:
        fits = [d for d in range(2, ppn + 1) if ppn % d == 0]
        out.append(
            f"distributed.tensor_parallel: {tp} spans nodes: tensor parallelism stays inside a node (its collectives "
            f"sit between the matmuls and need the intra-node links), and a node has {ppn} process"
            f"{'es' if ppn > 1 else ''}; " + (f"use one of {fits}" if fits else "set tensor_parallel: 1")
        )
    return out + [p for p in _model_problems(m, tp, ppn) if tp <= ppn or "processes per node" not in p]


def cp_config_problems(config: Config, hw: Hardware, m: ModelFacts) -> list[str]:
    """What the config, hardware and model class allow of context parallelism, whatever the degree
    (finetune/distributed/cp.py's rules, mirrored here so that planning needs no torch; the attention the planner
    chooses for the class: plan/attention.py)."""
    d, data = config.distributed, config.data
    out = []
    if hw.is_cpu:
        out.append("CPU: torch's ring attention replaces the CUDA attention kernels only (run it on GPUs)")
    if config.train.compile is True:
        out.append("train.compile: true: ft does not compile layers whose attention is replaced at run time")
    if not config.method.summed_loss:
        out.append(f"method {config.method.name}: context parallelism supports SFT only (set method.name: sft)")
    if data.packing:
        out.append("packing: ring attention needs whole causal sequences (set data.packing: false)")
    attn = config.model.attn_implementation
    if attn not in ("auto", "sdpa"):
        out.append(f"attn_implementation {attn}: ring attention wraps sdpa (set model.attn_implementation: sdpa)")
    elif (ring := ring_problem(config, hw, m)) is not None:
        out.append(ring)
    if d.backend not in TP_BACKENDS:
        out.append(f"backend {d.backend}: context parallelism composes with FSDP2 only (set distributed.backend: fsdp)")
    if d.sharding not in TP_SHARDINGS:
        out.append(f"sharding {d.sharding}: FSDP2 shards over the data- and context-parallel ranks (set full_shard)")
    return out


def cp_problems(config: Config, hw: Hardware, topo: Topology, m: ModelFacts, tp: int, cp: int) -> list[str]:
    """Why `cp` cannot run next to `tp`, each naming the constraint and the fix; empty when it can."""
    if cp == 1:
        return []
    out = cp_config_problems(config, hw, m)
    seq = config.data.seq_len
    if seq % (2 * cp):
        up = -(-seq // (2 * cp)) * 2 * cp
        out.append(
            f"each sequence is cut into 2 x {cp} chunks (balanced causal attention), so data.seq_len must divide by "
            f"{2 * cp}; {seq} does not (set data.seq_len: {up})"
        )
    if topo.world % (tp * cp):
        out.append(f"tensor_parallel {tp} x context_parallel {cp} does not divide the {topo.world} ranks")
    return [f"distributed.context_parallel: {cp}: {p}; or set context_parallel: auto" for p in out]


def check(config: Config, hw: Hardware, topo: Topology, m: ModelFacts) -> None:
    """Every problem of an explicit tensor- or context-parallel degree, together, as one PlanError."""
    d = config.distributed
    tp, cp = asked(d.tensor_parallel) or 1, asked(d.context_parallel) or 1
    problems = tp_problems(config, topo, m, tp) + cp_problems(config, hw, topo, m, tp, cp)
    if not problems and topo.world % (tp * cp):
        problems.append(
            f"distributed.tensor_parallel {tp} x context_parallel {cp}: their product must divide the "
            f"{topo.world} ranks"
        )
    if problems:
        raise PlanError("\n".join(problems))


def _powers(n: int) -> list[int]:
    """The powers of two above 1 that divide n."""
    return [d for d in (2, 4, 8, 16, 32, 64) if n % d == 0]


def tp_degrees(config: Config, hw: Hardware, topo: Topology, m: ModelFacts) -> list[int]:
    """Tensor-parallel degrees to try: the one asked, else 1 and (on GPUs, for methods that do not sample) every power
    of two that divides a node's processes and the model's heads and MLP."""
    explicit = asked(config.distributed.tensor_parallel)
    if explicit:
        return [explicit]
    if (
        hw.is_cpu
        or topo.world == 1
        or tp_config_problems(config)
        or config.method.generation_tokens(config.data.seq_len)
    ):
        return [1]
    ppn = topo.processes_per_node
    return [1] + [d for d in _powers(ppn) if not _model_problems(m, d, ppn)]


def cp_degrees(config: Config, hw: Hardware, topo: Topology, m: ModelFacts) -> list[int]:
    """Context-parallel degrees to try: the one asked, else 1 and (on GPUs, for sequences of CP_MIN_SEQ tokens or
    more, where the model class runs SDPA) every power of two that divides a node's processes and half the
    sequence."""
    explicit = asked(config.distributed.context_parallel)
    if explicit:
        return [explicit]
    seq = config.data.seq_len
    if topo.world == 1 or seq < CP_MIN_SEQ or cp_config_problems(config, hw, m):
        return [1]
    return [1] + _powers(topo.processes_per_node)


def degrees(config: Config, hw: Hardware, topo: Topology, m: ModelFacts) -> list[tuple[int, int]]:
    """(tp, cp) pairs the search tries: auto ones inside a node (tp x cp divides a node's processes) and dividing
    the sequence; explicit degrees as asked (checked by `check`)."""
    d = config.distributed
    want_tp, want_cp = asked(d.tensor_parallel), asked(d.context_parallel)
    ppn, seq = topo.processes_per_node, config.data.seq_len
    out = []
    for tp in tp_degrees(config, hw, topo, m):
        for cp in cp_degrees(config, hw, topo, m):
            inner = tp * cp
            if inner == 1 or (ppn % inner == 0 and seq % (2 * cp) == 0):
                out.append((tp, cp))
            elif (want_tp or 1) == tp and (want_cp or 1) == cp and (want_tp or want_cp):
                out.append((tp, cp))  # as asked, across nodes (a context-parallel ring may span them)
    return out
