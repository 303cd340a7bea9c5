"""Network traffic of one optimizer step per rank, by backend: the planner's communication estimate.

Ring collectives over n ranks move (n-1)/n of the buffer per rank for all-gather and reduce-scatter,
twice that for all-reduce. G = trained parameters x 4 bytes (fp32 gradients; 2 where they are half precision:
DeepSpeed's bf16/fp16 modes and pure bf16), P = all parameters in
the dtype they are stored in (what sharded backends gather: 2 bytes for bf16, about 0.55 for nf4 with
its constants), k = micro-batches per step, r = gradient reductions per step: k where the engine reduces after every
micro-batch (`reduces_every_micro_batch`), else 1.
  DDP:                    all-reduce of G once per step (no_sync until the last micro-batch)
  ZeRO-1:                 reduce-scatter of G once per step (in step()), then an all-gather of the updated trained
                          parameters (as many bytes as G: DeepSpeed keeps them in the gradients' dtype; frozen
                          weights are not partitioned, so an adapter's base is never gathered)
  ZeRO-2:                 reduce-scatter of G every micro-batch, then the same all-gather as ZeRO-1
  FSDP full / ZeRO-3:     all-gather P twice per micro-batch (forward, backward) + reduce-scatter G r times
  FSDP shard_grad_op:     all-gather P once per micro-batch + reduce-scatter G r times
  FSDP hybrid_shard:      full_shard inside a node, plus r all-reduces of each node's shard of G across nodes
With tensor parallelism over tp ranks (plan/parallel.py) FSDP's group is the dp x cp ranks of one tensor-parallel
slot, and P and G count one tp rank's share (decoder layers / tp, embeddings and head whole). Per micro-batch of t
tokens (t / cp on each context-parallel rank), a = bytes of the compute dtype, L layers (c of them recomputed):
  tensor parallel:        with sequence-parallel norms, an all-gather before and a reduce-scatter after attention
                          and the MLP: 4 collectives of t*h*a per layer forward, 4 backward, 4 per recomputed layer,
                          always inside a node
  context parallel:       ring attention passes every rank's keys and values around the ring: 2*t*kv*a per layer
                          forward, twice that backward (keys and values again, their gradients), once more per
                          recomputed layer
  expert parallel:        over ep ranks (plan/expert_parallel.py): the experts' share of P and G moves among the
                          world / ep ranks that hold the same experts, 1/ep of it per rank; the routed tokens' hidden
                          states (t*k*h*a, k experts per token) cross an all-to-all twice per layer forward, twice
                          backward, twice per recomputed layer, inside a node where ep divides its processes
Times assume 100 GB/s per GPU inside a node (NVLink class) and 12.5 GB/s per GPU between nodes
(100 Gb/s links), unless the hardware says otherwise (`links`); they are orders of magnitude, for comparing setups,
not promises.
"""

from __future__ import annotations

from dataclasses import dataclass

INTRA_NODE_BPS = 100e9
INTER_NODE_BPS = 12.5e9
TENSOR_PARALLEL = "tensor-parallel activations (in node)"
CONTEXT_PARALLEL = "context-parallel keys and values (ring)"
EXPERT_PARALLEL = "expert-parallel routed tokens (all-to-all in node)"
EXPERT_PARALLEL_NODES = "expert-parallel routed tokens (all-to-all across nodes)"


@dataclass(frozen=True)
class Links:
    """Bytes per second per GPU inside a node and between nodes."""

    intra: float = INTRA_NODE_BPS
    inter: float = INTER_NODE_BPS


def links(hw) -> Links:
    """The link speeds the hardware knows (`intra_node_bps`, `inter_node_bps`), else this module's assumptions."""
    intra = getattr(hw, "intra_node_bps", None) or INTRA_NODE_BPS
    inter = getattr(hw, "inter_node_bps", None) or INTER_NODE_BPS
    return Links(float(intra), float(inter))


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def reduces_every_micro_batch(backend: str, sharding: str | None, adapter: str) -> bool:
    """Whether the engine reduces gradients after every micro-batch rather than once per step. ZeRO-2 and ZeRO-3
    partition gradients as each backward produces them (deepspeed 0.19, unmanaged accumulation: engine.step "stage 2/3
    already reduced/partitioned per backward", stage_1_and_2 reduce_ready_partitions_and_remove_grads); FSDP2 full
    fine-tuning syncs every micro-batch (distributed/engine.py `sync_every_micro_batch`: an unsharded fp32 gradient of
    the whole model would not fit). DDP (no_sync), ZeRO-1 (reduced in step()) and FSDP2 with an adapter reduce once."""
    return sharding in ("zero2", "zero3") or (backend == "fsdp" and adapter == "full")


def step_traffic(
    backend: str,
    sharding: str | None,
    nodes: int,
    per_node: int,
    trainable: int,
    params: int,
    bytes_per_param: float,
    micro_batches: int,
    *,
    adapter: str,
    grad_bytes: float = 4,
    tensor_parallel: int = 1,
) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective (bytes_per_param: as gathered, e.g. 2 for bf16, ~0.55 for
    nf4; adapter: full | lora | qlora, which decides how often FSDP2 reduces)."""
    world = nodes * per_node
    grads, weights = grad_bytes * trainable, bytes_per_param * params
    if world == 1 or backend == "single":
        return {}
    reductions = micro_batches if reduces_every_micro_batch(backend, sharding, adapter) else 1
    if sharding in ("zero1", "zero2"):  # each rank reduces its partition, then gathers the trained parameters
        return {
            "reduce-scatter gradients": reductions * _ring(world) * grads,
            "all-gather updated parameters": _ring(world) * grads,
        }
    if backend == "ddp":
        return {"all-reduce gradients": 2 * _ring(world) * grads}
    group = (per_node if sharding == "hybrid_shard" else world) // tensor_parallel
    gathers = 1 if sharding == "shard_grad_op" else 2
    out = {
        "all-gather parameters": gathers * micro_batches * _ring(group) * weights,
        "reduce-scatter gradients": reductions * _ring(group) * grads,
    }
    if sharding == "hybrid_shard":
        out["all-reduce gradient shards across nodes"] = reductions * 2 * _ring(nodes) * grads / per_node
    return out if tensor_parallel == 1 else {k: v for k, v in out.items() if v}


def parallel_traffic(
    tokens: float,
    hidden: int,
    kv_dim: int,
    layers: int,
    recomputed: int,
    act_bytes: int,
    micro_batches: int,
    tp: int,
    cp: int,
) -> dict[str, float]:
    """Bytes each rank sends per step for tensor- and context-parallel activations (tokens: per micro-batch, whole
    sequences; see the module docstring)."""
    out = {}
    local = tokens / cp
    if tp > 1:
        collectives = 8 * layers + 4 * recomputed
        out[TENSOR_PARALLEL] = micro_batches * collectives * _ring(tp) * local * hidden * act_bytes
    if cp > 1:
        passes = 3 * layers + recomputed
        out[CONTEXT_PARALLEL] = micro_batches * passes * 2 * _ring(cp) * tokens * kv_dim / tp * act_bytes
    return out


def expert_parallel_traffic(
    step: dict[str, float],
    world: int,
    per_node: int,
    ep: int,
    shares: tuple[float, float],
    tokens: float,
    hidden: int,
    top_k: int,
    layers: int,
    recomputed: int,
    act_bytes: int,
    micro_batches: int,
) -> dict[str, float]:
    """`step` (FSDP2's bytes per rank, step_traffic) under expert parallelism over ep of the world ranks: the experts'
    share of the gathered parameters and of the reduced gradients (`shares`) moves among the world / ep ranks that hold
    the same experts, 1/ep of it per rank; each micro-batch's routed (token, expert) pairs (tokens x top_k hidden
    states) cross the all-to-all twice per layer forward (dispatch, combine), twice backward, twice per recomputed
    layer, (ep - 1)/ep of them to other ranks (uniform routing), inside a node where ep divides its processes."""
    out = dict(step)
    kept = _ring(world // ep) / (ep * _ring(world)) if world > 1 else 0.0
    for name, share in (("all-gather parameters", shares[0]), ("reduce-scatter gradients", shares[1])):
        if name in out:
            out[name] *= 1 - share + share * kept
    passes = 4 * layers + 2 * recomputed
    name = EXPERT_PARALLEL if per_node % ep == 0 else EXPERT_PARALLEL_NODES
    out[name] = micro_batches * passes * _ring(ep) * tokens * top_k * hidden * act_bytes
    return out


def crosses(name: str, nodes: int, sharding: str | None, per_node: int = 1, inner: int = 1) -> bool:
    """Whether a collective runs over inter-node links: tensor parallelism never does (it stays in a node), a
    context-parallel ring does when tp x cp ranks (`inner`) outgrow a node, hybrid_shard only for its across-nodes
    all-reduce, every other collective whenever the job spans nodes."""
    if name in (TENSOR_PARALLEL, EXPERT_PARALLEL):
        return False
    if name == CONTEXT_PARALLEL:
        return nodes > 1 and inner > per_node
    return nodes > 1 and (sharding != "hybrid_shard" or "across nodes" in name)


def collective_seconds(
    traffic: dict[str, float],
    nodes: int,
    sharding: str | None,
    per_node: int = 1,
    inner: int = 1,
    speeds: Links = Links(),
) -> dict[str, float]:
    """Seconds of each collective at the link speeds (inter-node links for collectives spanning nodes)."""
    return {
        name: size / (speeds.inter if crosses(name, nodes, sharding, per_node, inner) else speeds.intra)
        for name, size in traffic.items()
    }
