"""How long a job takes to stop cleanly: finish the step in progress, then write a checkpoint.

A scheduler is asked for that much warning before it kills the job (Slurm's `--signal=B:USR1@N`, Kubernetes'
terminationGracePeriodSeconds), and torchrun's shutdown timeout is set to cover it. The checkpoint is what
output.save_steps writes: the trained weights (the adapter, or the whole model), the fp32 master copy where one is
kept, and the optimizer states. Sharded backends write their shards from every node at once; the others write one
copy from rank 0.
"""

from __future__ import annotations

import math

from finetune.plan.memory import Estimate

WRITE_BYTES_PER_S = 2**30  # per node, to a shared filesystem under load: a low figure, so that the warning is ample
SLACK_S = 90  # Slurm sends --signal up to 60 s off the requested time; the rest: a stop noticed between steps
MIN_STOP_S = 180
MAX_STOP_S = 65535  # the most Slurm's --signal accepts
_SAVED = ("master weights", "adapter", "optimizer")  # estimate components a checkpoint writes, besides full weights


def checkpoint_bytes_per_node(
    estimate: Estimate, adapter: str, sharded_state: bool, sharded_params: bool, processes_per_node: int
) -> int:
    """Bytes the busiest node writes for one checkpoint: its ranks' shards, or rank 0's one copy (weights that
    every rank holds whole are written once)."""
    state = processes_per_node if sharded_state else 1
    weights = processes_per_node if sharded_params else 1
    per_device = sum(estimate.device.get(k, 0) for k in _SAVED) * state
    if adapter == "full":
        per_device += estimate.device.get("weights", 0) * weights
    offloaded = (*(f"offloaded {k}" for k in (*_SAVED, "weights")), "paged optimizer states")
    in_host = sum(estimate.host.get(k, 0) for k in offloaded)  # the node's processes together
    return int(per_device + in_host * state / processes_per_node)


def stop_seconds(step_seconds: float, checkpoint_bytes: int) -> int:
    """Seconds from a stop signal to a complete checkpoint, with slack, in whole minutes."""
    needed = step_seconds + checkpoint_bytes / WRITE_BYTES_PER_S + SLACK_S
    return int(min(MAX_STOP_S, max(MIN_STOP_S, 60 * math.ceil(needed / 60))))
