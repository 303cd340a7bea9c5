"""The one builder of launch commands: how a job's ranks start (`ft train`, `ft plan`, Slurm, `ft generate`).

A rank is `python -m finetune.rank RUN_DIR`: it starts from the run folder that `ft train` wrote
(config.yaml, plan.json, data.json) and never re-plans. Several ranks, or a backend that needs a process
group even for one (FSDP2, DeepSpeed), start through torchrun: standalone on one node; across nodes
the same command on every node, with that node's rank and the address of node 0 (a static rendezvous), or
with a rendezvous id for torchrun's c10d rendezvous at node 0's address (Kubernetes: a pod that restarts
joins again; torchrun numbers the nodes).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from finetune.plan.plan import Plan

DEFAULT_PORT = 29500
RANK_ENTRY = "finetune.rank"
# Each node prepares its data before it joins the rendezvous: a node with a cold data cache may join long after the
# others, which must not give up on it (torchrun's default: 600 s)
RDZV_JOIN_TIMEOUT_S = 1800


def needs_launcher(backend: str, world_size: int) -> bool:
    """Started through torchrun: several ranks, or a backend that needs a process group even for one."""
    return world_size > 1 or backend in ("fsdp", "deepspeed")


def launch_command(
    plan: Plan,
    run_dir: str,
    *,
    node_rank: int | str | None = None,
    master_addr: str | None = None,
    master_port: int = DEFAULT_PORT,
    python: str | None = None,
    resume_from: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """The command that starts this node's ranks of `plan`'s job: what `ft plan` shows (python=None, the portable
    form, with placeholders for the node) and what `ft train` runs (its interpreter, this node's rank, the checkpoint
    it resumes from). The plan alone decides the nodes, the ranks per node, whether they need a process group and how
    long a stop's checkpoint may take (torchrun's shutdown timeout: only in the command ft runs, as whether torchrun
    takes the option depends on the torch that runs it; ft's launcher also sets it in the environment)."""
    entry = ["-m", RANK_ENTRY, str(run_dir), *(["--resume-from", str(resume_from)] if resume_from else [])]
    if not plan.process_group or (plan.rollout is not None and plan.rollout.placement == "ray"):  # one rank's command
        return [python or "python", *entry]
    return torchrun(
        entry,
        plan.nodes,
        plan.processes_per_node,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        python=python,
        rdzv_id=rdzv_id,
        shutdown_timeout=plan.stop_seconds if python else None,
    )


def torchrun(
    entry: list[str],
    nodes: int,
    processes_per_node: int,
    *,
    node_rank: int | str | None = None,
    master_addr: str | None = None,
    master_port: int = DEFAULT_PORT,
    python: str | None = None,
    rdzv_id: str | None = None,
    shutdown_timeout: int | None = None,
) -> list[str]:
    """torchrun running `entry` (e.g. ["-m", "module", args...]) on nodes x processes_per_node ranks; unknown node
    rank or address become `$NODE_RANK` / `$MASTER_ADDR` placeholders for a script to fill in. With `rdzv_id`, the
    nodes meet through torchrun's c10d rendezvous at the address of node 0 instead of a static one.
    `shutdown_timeout`: seconds torchrun gives its workers to exit after a signal it handles (a checkpoint's time),
    where this torch's torchrun has the option (ft's launcher also sets TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
    cmd = ["torchrun"] if python is None else [python, "-m", "torch.distributed.run"]
    cmd += [f"--nnodes={nodes}", f"--nproc-per-node={processes_per_node}"]
    if nodes == 1:
        cmd.append("--standalone")
    elif rdzv_id:
        endpoint = f"{master_addr or '$MASTER_ADDR'}:{master_port}"
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
        cmd.append(f"--rdzv-conf=join_timeout={RDZV_JOIN_TIMEOUT_S}")
    else:
        rank = "$NODE_RANK" if node_rank is None else node_rank
        cmd += [f"--node-rank={rank}", f"--master-addr={master_addr or '$MASTER_ADDR'}", f"--master-port={master_port}"]
    if shutdown_timeout and has_shutdown_timeout():
        cmd.append(f"--shutdown-timeout={int(shutdown_timeout)}")
    return cmd + list(entry)


@functools.cache
def has_shutdown_timeout() -> bool:
    """Whether this torch's torchrun takes --shutdown-timeout (older ones read only the environment variable)."""
    try:
        from torch.distributed.run import get_args_parser
    except ImportError:
        return False
    return "--shutdown-timeout" in get_args_parser().format_help()
