"""Network traffic of one optimizer step per rank, by backend: the planner's communication estimate.

Ring collectives over n ranks move (n-1)/n of the buffer per rank for all-gather and reduce-scatter,
twice that for all-reduce. G = trained parameters x 4 bytes (fp32 gradients; 2 where they are half precision:
DeepSpeed's bf16/fp16 modes and pure bf16), P = all parameters in
the dtype they are stored in (what sharded backends gather: 2 bytes for bf16, about 0.55 for nf4 with
its constants), k = micro-batches per step.
  DDP:                    all-reduce of G once per step
  ZeRO-1/2:               reduce-scatter of G once per step, then an all-gather of the updated parameters
  FSDP full / ZeRO-3:     all-gather P twice per micro-batch (forward, backward) + reduce-scatter G per step
  FSDP shard_grad_op:     all-gather P once per micro-batch + reduce-scatter G per step
  FSDP hybrid_shard:      full_shard inside a node, plus an all-reduce of each node's shard of G across nodes
Times assume 100 GB/s per GPU inside a node (NVLink class) and 12.5 GB/s per GPU between nodes
(100 Gb/s links); they are orders of magnitude, for comparing setups, not promises.
"""

from __future__ import annotations

INTRA_NODE_BPS = 100e9
INTER_NODE_BPS = 12.5e9


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def step_traffic(
    backend: str,
    sharding: str | None,
    nodes: int,
    per_node: int,
    trainable: int,
    params: int,
    bytes_per_param: float,
    micro_batches: int,
    grad_bytes: float = 4,
) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective (bytes_per_param: as gathered, e.g. 2 for bf16, ~0.55 for
    nf4)."""
    world = nodes * per_node
    grads, weights = grad_bytes * trainable, bytes_per_param * params
    if world == 1 or backend == "single":
        return {}
    if sharding in ("zero1", "zero2"):  # each rank reduces only its partition, then gathers the updated parameters
        return {
            "reduce-scatter gradients": _ring(world) * grads,
            "all-gather updated parameters": _ring(world) * weights,
        }
    if backend == "ddp":
        return {"all-reduce gradients": 2 * _ring(world) * grads}
    group = per_node if sharding == "hybrid_shard" else world
    gathers = 1 if sharding == "shard_grad_op" else 2
    out = {
        "all-gather parameters": gathers * micro_batches * _ring(group) * weights,
        "reduce-scatter gradients": _ring(group) * grads,
    }
    if sharding == "hybrid_shard":
        out["all-reduce gradient shards across nodes"] = 2 * _ring(nodes) * grads / per_node
    return out


def seconds(traffic: dict[str, float], nodes: int, sharding: str | None) -> float:
    """Time at the assumed bandwidths: inter-node links for collectives spanning nodes."""
    total = 0.0
    for name, size in traffic.items():
        crosses = nodes > 1 and (sharding != "hybrid_shard" or "across nodes" in name)
        total += size / (INTER_NODE_BPS if crosses else INTRA_NODE_BPS)
    return total
