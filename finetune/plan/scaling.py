"""Predicted scaling of the chosen plan: compute and communication seconds per step, how much of the communication
hides behind compute, and the efficiency against one device doing the same per-device work.

  work        every estimated step cost but communication (plan/cost.py: compute, recompute, launches,
              dequantization, host transfers): what one device would spend on this rank's share
  overlap     each collective hides behind a window of compute, and all of them together behind at most the
              compute itself:
              - FSDP's parameter all-gathers: prefetched during the previous layer's compute, so all but the first
                layer's gather of each pass (1/L of them) can hide behind the compute
              - gradient reduce-scatters and all-reduces (FSDP, DDP, ZeRO, hybrid_shard across nodes): issued layer
                by layer during the backward pass of the micro-batch they reduce (the last one; every one where the
                engine reduces each micro-batch, plan/comm.py `reduces_every_micro_batch`); all but the last layer's
                can hide behind it
              - ZeRO-1/2's all-gather of updated parameters: after the optimizer step, exposed
              - tensor parallelism's activation collectives: between the matmuls that need them, exposed
                (TP_HIDDEN of them hide)
              - context parallelism's key/value ring: the next chunk moves while attention computes on this one
                ((cp - 1) / cp of it, behind the attention's share of the compute)
  step        work + exposed communication: the plan's one estimated step time (Plan.step_seconds sums to it, and
              the search ranks setups by it)
  efficiency  work / (work + exposed communication); monotone in link speed, as slower links only add exposed time

Cross-node collectives are slower only through their link speed (plan/comm.py `links`); the figures rank setups and
say where the time goes, they are not measurements (scripts/gpu-check.sh measures).
"""

from __future__ import annotations

from finetune.plan.comm import CONTEXT_PARALLEL, TENSOR_PARALLEL, Links, collective_seconds, crosses

TP_HIDDEN = 0.0  # share of tensor parallelism's activation collectives that hides behind compute (no async TP)
GRADIENTS = ("reduce-scatter gradients", "all-reduce gradients", "all-reduce gradient shards across nodes")


def _hideable(
    name: str, compute: float, backward: float, attention: float, layers: int, cp: int
) -> tuple[float, float]:
    """(share of a collective that can hide, seconds of compute it can hide behind): the first layer's gather of each
    pass and the last layer's gradient reduction wait on nothing to overlap (see the module docstring)."""
    tail = 1 - 1 / max(layers, 1)
    if name == "all-gather parameters":
        return tail, compute
    if name in GRADIENTS:
        return tail, backward
    if name == CONTEXT_PARALLEL:
        return (cp - 1) / cp, attention
    if name == TENSOR_PARALLEL:
        return TP_HIDDEN, compute
    return 0.0, 0.0


def predict(
    seconds_by_cause: dict[str, float],
    traffic: dict[str, float],
    *,
    nodes: int,
    sharding: str | None,
    per_node: int,
    tp: int,
    cp: int,
    layers: int,
    micro_batches: int,
    backward_share: float,
    attention_share: float,
    speeds: Links = Links(),
    reduce_every_micro_batch: bool = False,
) -> dict:
    """The scaling figures of one plan (`Plan.scaling`): seconds_by_cause from plan/cost.py, traffic from
    plan/comm.py (bytes per rank and step), backward_share and attention_share of the compute;
    reduce_every_micro_batch: gradients are reduced behind every micro-batch's backward pass, not only the last."""
    work = sum(v for k, v in seconds_by_cause.items() if k != "communication")
    compute = sum(seconds_by_cause.get(k, 0.0) for k in ("compute", "recompute", "quantization"))
    reducing = 1 if reduce_every_micro_batch else max(micro_batches, 1)  # the reductions hide behind 1/reducing
    backward = seconds_by_cause.get("compute", 0.0) / reducing * backward_share  # of the backward passes
    attention = seconds_by_cause.get("compute", 0.0) * attention_share
    times = collective_seconds(traffic, nodes, sharding, per_node, tp * cp, speeds)
    rows, budget, hidden = {}, compute, 0.0
    for name, t in sorted(times.items(), key=lambda kv: kv[0] == TENSOR_PARALLEL):
        share, window = _hideable(name, compute, backward, attention, layers, cp)
        hides = min(t * share, window, budget)
        budget, hidden = budget - hides, hidden + hides
        link = "inter-node" if crosses(name, nodes, sharding, per_node, tp * cp) else "intra-node"
        rows[name] = {"seconds": round(t, 6), "hidden_seconds": round(hides, 6), "link": link}
    comm = sum(times.values())
    exposed = max(0.0, comm - hidden)
    return {
        "compute_seconds": round(work, 6),
        "communication_seconds": round(comm, 6),
        "overlapped_seconds": round(hidden, 6),
        "exposed_seconds": round(exposed, 6),
        "step_seconds": round(work + exposed, 6),
        "efficiency": round(work / (work + exposed), 4) if work + exposed > 0 else 1.0,
        "collectives": rows,
        "link_gb_per_s": {"intra_node": speeds.intra / 1e9, "inter_node": speeds.inter / 1e9},
    }


def summary(scaling: dict) -> str:
    """One line for `ft plan`: its step time is the plan's."""
    if not scaling:
        return ""
    s = scaling
    return (
        f"Predicted scaling: {s['efficiency']:.0%} of one device's speed (work {s['compute_seconds']:.3g} s per step, "
        f"all but communication; communication {s['communication_seconds']:.3g} s, of which "
        f"{s['overlapped_seconds']:.3g} s hides behind compute and {s['exposed_seconds']:.3g} s adds to the step: "
        f"{s['step_seconds']:.3g} s per step; links {s['link_gb_per_s']['intra_node']:g} GB/s in a node, "
        f"{s['link_gb_per_s']['inter_node']:g} GB/s between nodes)"
    )
