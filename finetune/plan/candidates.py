"""The candidate setups a config allows: adapter and quantization, backend, sharding and host offload, each pair of
lists least compromise first; and how each candidate loads its weights."""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.catalog import ModelFacts
from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.plan.parallel import TP_SHARDINGS, degrees
from finetune.plan.topology import Topology


@dataclass(frozen=True)
class Candidate:
    adapter: str
    quantization: str
    backend: str
    sharding: str | None
    offload: str
    host_load: bool = False  # a 4-bit base under FSDP2 quantized in host memory, then moved to the GPU shard by shard
    tp: int = 1  # tensor-parallel degree (plan/parallel.py)
    cp: int = 1  # context-parallel degree


def data_parallel(world: int, c: Candidate) -> int:
    """Ranks that see different rows: the world over the tensor- and context-parallel groups."""
    return world // (c.tp * c.cp)


def sharded_params(c: Candidate) -> bool:
    """Parameters themselves are split over ranks (FSDP2, ZeRO-3): a forward pass needs every rank."""
    return c.backend == "fsdp" or c.sharding == "zero3"


def loading(c: Candidate) -> str:
    """How ranks load the weights. FSDP2 and ZeRO-3 never hold a whole 16/32-bit copy per rank. A 4-bit base is loaded
    quantized by each rank (bitsandbytes quantizes while loading, so it cannot be filled into meta-device shards):
    onto its GPU (`replica`), or, under FSDP2 where that does not fit, into host memory (`host`), from where
    fully_shard moves it to the GPU one layer at a time as it shards it (torch _fsdp_init._move_states_to_device;
    bitsandbytes' Params4bit.to moves the quantization state along)."""
    if c.quantization != "none":
        return "host" if c.host_load else "replica"
    if c.backend == "fsdp":
        return "meta"
    return "partitioned" if c.sharding == "zero3" else "replica"


def candidates(config: Config, hw: Hardware, topo: Topology, m: ModelFacts) -> list[Candidate]:
    """Every setup the config allows, in preference order; host offload (slow) only after all others; each at the
    tensor- and context-parallel degrees the config allows for the model (plan/parallel.py)."""
    from finetune.config.checks import BNB_OPTIMIZERS

    # bitsandbytes optimizers cannot step FSDP2's DTensor parameters
    bnb_optimizer = config.train.optimizer in BNB_OPTIMIZERS
    out = [
        Candidate(a, q, b, s, o)
        for a, q in adapter_options(config)
        for b, s, o in backend_options(config, hw, topo)
        if not (q == "int8" and b in ("fsdp", "deepspeed")) and not (bnb_optimizer and b == "fsdp")
    ]
    out = [v for c in out for v in ([c, replace(c, host_load=True)] if host_loadable(c) else [c])]
    out = _with_degrees(out, degrees(config, hw, topo, m))
    return sorted(out, key=lambda c: c.offload != "none")


def _with_degrees(out: list[Candidate], pairs: list[tuple[int, int]]) -> list[Candidate]:
    """Each candidate at every (tp, cp) pair it can run with: FSDP2 over the data-parallel ranks, on GPUs, a 16-bit
    base; without (1, 1) among the pairs (an explicit degree) only those."""
    return [
        replace(c, tp=tp, cp=cp)
        for c in out
        for tp, cp in pairs
        if (tp, cp) == (1, 1)
        or (c.backend == "fsdp" and c.sharding in TP_SHARDINGS and c.offload == "none" and c.quantization == "none")
    ]


def host_loadable(c: Candidate) -> bool:
    """A 4-bit base that FSDP2 shards can be loaded in host memory instead of whole on each GPU."""
    return c.quantization == "nf4" and c.backend == "fsdp"


def adapter_options(config: Config) -> list[tuple[str, str]]:
    """(adapter, quantization) pairs to try, least compromise first."""
    a, q = config.adapter.type, config.quantization.type
    if a == "full":
        return [("full", "none")]
    if a == "qlora" or q == "nf4":
        return [("qlora", "nf4")]
    if q == "int8":
        return [("lora", "int8")]
    if a == "lora" or q == "none":
        return [("lora", "none")]
    return [("lora", "none"), ("qlora", "nf4")]


def backend_options(config: Config, hw: Hardware, topo: Topology) -> list[tuple[str, str | None, str]]:
    """(backend, sharding, offload) triples to try, least communication and host traffic first."""
    d = config.distributed
    if topo.world == 1 and d.backend in ("auto", "single"):
        opts = [("single", None, "none")]
        if d.backend == "auto" and not hw.is_cpu and d.offload in ("auto", "all"):
            opts.append(("fsdp", "full_shard", "all"))
        return opts
    backends = ["ddp", "fsdp"] if d.backend == "auto" else [d.backend]
    out = []
    for b in backends:
        for s in _shardings(b, d.sharding, topo, d.deepspeed_config):
            for o in _offloads(b, s, d.offload, hw):
                out.append((b, s, o))
    return out


def _shardings(backend: str, asked: str, topo: Topology, deepspeed_file: str | None = None) -> list[str | None]:
    if backend in ("ddp", "single"):
        return [None]
    if asked != "auto":
        if asked == "hybrid_shard" and topo.nodes == 1:
            raise PlanError(
                "distributed.sharding: hybrid_shard shards inside a node and replicates across nodes, but the "
                "job has 1 node; set sharding: full_shard (or auto)"
            )
        return [asked]
    if backend == "deepspeed":
        stage = users_stage(deepspeed_file)
        return [f"zero{stage}"] if stage else ["zero1", "zero2", "zero3"]
    return ["shard_grad_op"] + (["hybrid_shard"] if topo.nodes > 1 else []) + ["full_shard"]


def users_stage(path: str | None) -> int | None:
    """The ZeRO stage a user's DeepSpeed file sets (1-3), which `sharding: auto` follows; None when there is no file
    or it does not say (an unreadable file is reported where it is used: distributed/deepspeed.py)."""
    import json
    from pathlib import Path

    if path is None:
        return None
    try:
        stage = json.loads(Path(path).expanduser().read_text()).get("zero_optimization", {}).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return stage if stage in (1, 2, 3) else None


def _offloads(backend: str, sharding: str | None, asked: str, hw: Hardware) -> list[str]:
    if backend in ("ddp", "single"):
        return ["none"]
    if asked != "auto":
        if asked != "none" and hw.is_cpu:
            raise PlanError(
                f"distributed.offload: {asked} moves memory from GPUs to host RAM, but this hardware has no GPU; "
                "set offload: none (or auto)"
            )
        return [asked]
    if hw.is_cpu:
        return ["none"]
    if backend == "deepspeed":
        return ["none", "optimizer", "all"] if sharding == "zero3" else ["none", "optimizer"]
    return ["none", "all"] if sharding == "full_shard" else ["none"]
