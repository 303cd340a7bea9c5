"""`ft generate` / `ft eval` across nodes: the same command on every node, one shared filesystem.

Every node runs `ft generate ... --nnodes N --node-rank R --master-addr ADDR` (or under Slurm, which
sets them): node 0 reads and tokenizes the prompts, forms the batches and writes this attempt's plan into
OUT.parts/, as on one node; then every node starts its processes through torchrun, all of them ranks of
one torchrun job across the nodes. The ranks deal the batches among themselves exactly as on one node
(batch b goes to rank b mod world), each appends to its own part file, and node 0 merges the parts into OUT
once every rank has finished. OUT.parts/ must therefore be on a filesystem that every node sees (as a
training run folder is).

The ranks share two things through torchrun's store: the attempt node 0 planned (the other nodes' launchers
cannot know it), and, at the end, a barrier on a gloo group of their own (not torch's default group, which
vLLM may create in the same process): node 0's launcher merges only after every rank of every node has
written its part, and a rank that died on another node fails the barrier at once instead of leaving node 0
waiting.
"""

from __future__ import annotations

import datetime
import os
import sys

from finetune.errors import FtError

STORE_PREFIX = "ft-generate/"
ATTEMPT_KEY = "attempt"
# Joining the group and reading the attempt: ranks start together after torchrun's rendezvous, apart from their
# imports (minutes at most)
JOIN_TIMEOUT_S = 1800
# The last rank to finish may lag the first by about one batch and its model loading; a rank that died is noticed at
# once (its connections close), so this only bounds a rank that hangs
FINISH_TIMEOUT_S = 4 * 3600


def spans_nodes(role) -> bool:
    """Whether this job runs on more than one node (`role`: finetune.workflow.NodeRole, or None)."""
    return role is not None and (role.nnodes or 1) > 1


def check_role(role) -> None:
    """The flags a node of a multi-node job needs, or an error naming them."""
    if not 0 <= role.node_rank < role.nnodes:
        raise FtError(
            f"--node-rank {role.node_rank} with --nnodes {role.nnodes}: a node's rank is 0 .. {role.nnodes - 1}.\n"
            "    fix: give each node its own --node-rank from 0 to --nnodes - 1"
        )
    if not role.master_addr:
        raise FtError(
            f"generation across {role.nnodes} nodes needs the address of node 0.\n    fix: run the same command on "
            "every node with --node-rank and --master-addr (node 0's address), or under Slurm (ft launch generate "
            "--slurm writes the script)"
        )


def worker_command(parts, attempt: int | None, role, per_node: int, gpus: int) -> list[str]:
    """torchrun starting this node's `per_node` ranks of a job over `role.nnodes` nodes. Node 0 passes the attempt it
    planned; the other nodes pass "-" and their ranks read it from the store. `gpus`: this node's GPUs."""
    from finetune.plan.launch import RDZV_JOIN_TIMEOUT_S, torchrun

    entry = ["-m", "finetune.infer.worker", str(parts), "-" if attempt is None else str(attempt)]
    entry += ["--nodes", str(role.nnodes), "--gpus", str(gpus)]
    if not role.rdzv_id:  # the other nodes wait while node 0 tokenizes every prompt (torchrun's static default: 600 s)
        entry = [f"--rdzv-conf=timeout={RDZV_JOIN_TIMEOUT_S}", *entry]
    return torchrun(
        entry,
        role.nnodes,
        per_node,
        node_rank=role.node_rank,
        master_addr=role.master_addr,
        master_port=role.master_port,
        python=sys.executable,
        rdzv_id=role.rdzv_id,
    )


class NodeGroup:
    """The ranks of one torchrun job across nodes, joined through the store torchrun's agent keeps for its workers
    (MASTER_ADDR:MASTER_PORT of each rank's environment): read once, before anything (vLLM) hides those variables."""

    def __init__(self, rank: int, world: int):
        import torch.distributed as dist

        self.rank, self.world = rank, world
        join = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._store = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(address, port, is_master=False, timeout=join))
        # gloo, CPU only: nothing of the group touches a GPU, so it is the same on GPU nodes
        self._group = dist.ProcessGroupGloo(self._store, rank, world, join)

    def attempt(self, planned: int | None) -> int:
        """The attempt node 0 planned: its ranks (which know it) publish it, the others read it."""
        if planned is not None:
            self._store.set(ATTEMPT_KEY, str(planned))
            return planned
        return int(self._store.get(ATTEMPT_KEY).decode())

    def finish(self, finish_timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Wait until every rank of every node has written its part; an error naming the cause if one cannot."""
        import torch.distributed as dist

        options = dist.BarrierOptions()
        options.timeout = datetime.timedelta(seconds=finish_timeout_s)
        try:
            self._group.barrier(options).wait()
        except RuntimeError as e:
            cause = str(e).splitlines()[0][:300]
            what = (
                f"the other processes have not finished their share after {finish_timeout_s:.0f} s"
                if "timed out" in cause.lower()
                else "another process stopped before finishing its share"
            )
            raise FtError(
                f"process {self.rank} of {self.world}: {what} ({cause}).\n    fix: see that process's error (on its "
                "node); correct the cause and run the same command on every node again: rows already written are kept"
            ) from None
