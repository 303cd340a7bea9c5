"""`method.rollout.placement: ray`: ft train runs a GRPO job's trainer ranks and vLLM servers as actors of a Ray
cluster (`ray start` on each node, or a cluster KubeRay or a Slurm script started).

The plan decides the layout (plan/rollout.py): which logical node trains (nodes 0 .. plan.nodes - 1, the trainer's
processes_per_node ranks each) and where the engines run (`engine_nodes` whole nodes after the trainer's, one vLLM
server each holding that node's engines as vLLM's data-parallel ranks; or one server on node 0 next to the trainer).
Here each logical node is given a node of the cluster that has the resources (the driver's node first), and one
placement group reserves every bundle at once, each pinned to its node by Ray's `ray.io/node-id` label: a bundle of
one GPU per rank, one of the engine GPUs per server (CPU only: one CPU each).

The run goes: the servers start (rollout-engines.json in the run folder lists their addresses while they run), then
the ranks (rollout/ray_actors.py: the same `python -m finetune.rank` as under torchrun, with torchrun's variables; the
ranks' clients find the servers through the run folder). The run folder and the data cache must be on a file system
every node shares (as checkpoints across nodes need anyway). The launcher then waits: all ranks done is success; a
rank that fails, a server that exits or an actor whose node is lost ends the job with a message naming it (its log,
and `ft train ... --resume`); a stop signal is passed on to the ranks, which finish their step and save a checkpoint.
However it ends, the servers are stopped, the actors killed and the placement group removed.
"""

from __future__ import annotations

import os
import secrets
import signal
from dataclasses import dataclass
from pathlib import Path

from finetune.artifacts.run import RunFolder
from finetune.errors import FtError, Stopped
from finetune.files import atomic_write_text
from finetune.rollout.factory import TOKEN_ENV

NODE_LABEL = "ray.io/node-id"  # Ray's label of every node: its id
READY_TIMEOUT_S = 900  # the placement group's resources, then each server loading its model
STOP_GRACE_S = 60  # after the first failure: the other ranks' time to end before they are killed
# Passed to every actor (and so to the ranks and servers): ft's own switches and the libraries' (offline hubs, thread
# counts, NCCL and vLLM settings, trackers' keys). A Ray worker's environment is its raylet's, not ft train's.
FORWARDED = (
    "FT_",
    "HF_",
    "TRANSFORMERS_",
    "VLLM_",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "WANDB_",
    "MLFLOW_",
    "OMP_NUM_THREADS",
)


@dataclass(frozen=True)
class Bundle:
    """One actor's reservation: on which of the plan's nodes, for what."""

    node: int  # the plan's node (0 .. nodes + engine_nodes - 1)
    role: str  # rank | engine
    index: int  # the rank, or the server
    gpus: int

    def resources(self) -> dict[str, float]:
        return {"CPU": 1.0, **({"GPU": float(self.gpus)} if self.gpus else {})}


def bundles(plan) -> list[Bundle]:
    """Every actor of the job, in the plan's layout: the ranks in order, then the servers."""
    r, gpu = plan.rollout, plan.device == "GPU"
    out = [Bundle(rank // plan.processes_per_node, "rank", rank, 1 if gpu else 0) for rank in range(plan.world_size)]
    servers = r.engine_nodes or 1
    for s in range(servers):
        node = plan.nodes + s if r.engine_nodes else 0
        out.append(Bundle(node, "engine", s, r.server_gpus // servers if gpu else 0))
    return out


@dataclass(frozen=True)
class Node:
    """A live node of the Ray cluster."""

    id: str
    address: str
    cpus: float
    gpus: float


def assign(wanted: list[Bundle], nodes: list[Node], where: str) -> dict[int, Node]:
    """The cluster's node for each of the plan's nodes: in order, the first unused one with room for its bundles
    (`nodes` lists the driver's node first). Refused with what is missing, before anything starts."""
    need: dict[int, list[float]] = {}
    for b in wanted:
        cpus, gpus = need.setdefault(b.node, [0.0, 0.0])
        need[b.node] = [cpus + 1, gpus + b.gpus]
    chosen: dict[int, Node] = {}
    for k in sorted(need):
        cpus, gpus = need[k]
        fit = next((n for n in nodes if n not in chosen.values() and n.cpus >= cpus and n.gpus >= gpus), None)
        if fit is None:
            have = "; ".join(f"{n.address} ({n.cpus:g} CPUs, {n.gpus:g} GPUs)" for n in nodes) or "none"
            raise FtError(
                f"method.rollout.placement: ray: the plan places its actors on {len(need)} nodes, and its node {k} "
                f"needs {cpus:g} CPUs and {gpus:g} GPUs, but the Ray cluster at {where} has no other such node (its "
                f"live nodes: {have}).\n    fix: add nodes to the cluster (ray start --address on each), or plan "
                "for the cluster it has (ft train --hardware, e.g. 2x8xH100-80GB)"
            )
        chosen[k] = fit
    return chosen


def rank_environment(plan, b: Bundle, places: list[dict], run_dir: Path) -> dict[str, str]:
    """torchrun's variables for rank `b.index`, from where Ray placed each rank (`places[rank]`: its node's address,
    a free port there, the GPU ids Ray gave its actor): the process group at rank 0's node; on GPUs, the GPUs of its
    node's ranks all visible in local-rank order, so that device LOCAL_RANK is its own (as torchrun leaves them), and
    the address vLLM's NCCL weight transfer reaches rank 0 at."""
    from finetune.distributed.lifecycle import ENV_STOP_SECONDS

    local = b.index % plan.processes_per_node
    node_ranks = range(b.index - local, b.index - local + plan.processes_per_node)
    env = {
        "RANK": str(b.index),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(plan.processes_per_node),
        "GROUP_RANK": str(b.node),
        "NODE_RANK": str(b.node),
        "MASTER_ADDR": places[0]["address"],
        "MASTER_PORT": str(places[0]["port"]),
    }
    if plan.stop_seconds:  # a stop's checkpoint may take this long (distributed/lifecycle.py)
        env[ENV_STOP_SECONDS] = str(plan.stop_seconds)
    if plan.device == "GPU":
        from finetune.distributed.runtime import nccl_environment
        from finetune.rollout.nccl import ADDRESS_ENV

        env["CUDA_VISIBLE_DEVICES"] = ",".join(places[r]["gpus"][0] for r in node_ranks)
        env[ADDRESS_ENV] = places[0]["address"]  # where the servers' workers reach rank 0
        env.update(nccl_environment(run_dir))
    else:
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return env


def address(section) -> str:
    """The cluster to join: method.rollout.ray_address, else RAY_ADDRESS, else the one this machine belongs to."""
    return section.ray_address or os.environ.get("RAY_ADDRESS") or "auto"


def actor_env(token: str) -> tuple[dict[str, str], dict[str, str]]:
    """What every actor's processes get from ft train's environment: (the job's runtime environment, the secrets).
    The secrets (the rollout token, secret-named variables: trackers' keys, hub tokens) go to each actor's call and
    from there to its process only: Ray's runtime-env agent writes a runtime environment into its log."""
    from finetune.redaction import secret_variable

    forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}
    hidden = {k: v for k, v in forwarded.items() if secret_variable(k)}
    hidden[TOKEN_ENV] = token
    return {k: v for k, v in forwarded.items() if k not in hidden}, hidden


def ended(message: str, run_dir: Path) -> FtError:
    """The error that ends a job whose rank or server failed, with where it can resume from."""
    from finetune import checkpoint

    last = checkpoint.latest(run_dir)
    kept = f"the newest checkpoint is {last}" if last else "no checkpoint was written yet"
    return FtError(f"{message}\n{kept}; `ft train CONFIG --resume` continues from it with new actors")


def stopped(signum: int, run_dir: Path) -> Stopped:
    from finetune import checkpoint
    from finetune.distributed.lifecycle import signal_name

    last = checkpoint.latest(run_dir)
    kept = f"the newest checkpoint is {last}" if last else "no checkpoint was written"
    return Stopped(f"stopped by {signal_name(signum)}: {kept}. Resume with: ft train CONFIG --resume", signum)


def write_engines(run_dir: Path, engines: list[tuple[str, str, int]]) -> None:
    """The servers' addresses for the ranks, with their node and process (url, node address, pid)."""
    import json

    folder = RunFolder(run_dir)
    listing = [{"url": url, "node": node, "pid": pid} for url, node, pid in engines]
    atomic_write_text(folder.rollout_engines_path, json.dumps({"engines": listing}) + "\n")


def new_token() -> str:
    return secrets.token_hex(16)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
