"""The device mesh of a job with tensor or context parallelism: named dimensions `dp`, `cp`, `tp`, tp innermost.

Rank r sits at (r // (cp·tp), (r // tp) % cp, r % tp): the ranks of one tensor-parallel group are consecutive, so
they are on one node (the planner only makes tp divide a node's processes), then the context-parallel group, then
data parallelism across groups. The ranks of one tp × cp block train on the same rows (`data_rank`), so every
data-parallel quantity (the sampler's share, the normaliser, token counts) is taken over `data_world` groups.

FSDP2 shards parameters over `shard_mesh(mesh)`: the dp dimension, with cp folded in where cp > 1 (each cp rank
holds different tokens of the same rows, so their gradients are summed like data parallelism's).
A job without tp or cp has no mesh here: `device_mesh` returns None and FSDP2 builds its own.
"""

from __future__ import annotations

DP, CP, TP = "dp", "cp", "tp"
_MESHES: dict[tuple, object] = {}  # one mesh per process and layout: its process groups are made once


def replicas(tensor_parallel: int, context_parallel: int) -> int:
    """How many consecutive ranks train on the same rows (one tp × cp block)."""
    return tensor_parallel * context_parallel


def data_rank(rank: int, tensor_parallel: int, context_parallel: int) -> int:
    """The data-parallel rank of global rank `rank` (which share of each step's rows it trains on)."""
    return rank // replicas(tensor_parallel, context_parallel)


def data_world(world_size: int, tensor_parallel: int, context_parallel: int) -> int:
    """How many data-parallel groups the ranks form (the shares each step's rows are dealt into)."""
    return world_size // replicas(tensor_parallel, context_parallel)


def device_mesh(device_type: str, world_size: int, tensor_parallel: int = 1, context_parallel: int = 1):
    """The job's (dp, cp, tp) mesh, made once per process; None when tp and cp are both 1."""
    if tensor_parallel == 1 and context_parallel == 1:
        return None
    if world_size % replicas(tensor_parallel, context_parallel):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_parallel {tensor_parallel} × context_parallel "
            f"{context_parallel}"
        )
    shape = (data_world(world_size, tensor_parallel, context_parallel), context_parallel, tensor_parallel)
    key = (device_type, shape)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        # GPUs: device_type "cuda", each rank on cuda:LOCAL_RANK (runtime.start); the dimension groups are split from
        # the default "cpu:gloo,cuda:nccl" group, so TP's activation collectives (CUDA tensors) go over NCCL
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=(DP, CP, TP))
    return _MESHES[key]


EFSDP, EP, ETP = "efsdp", "ep", "etp"  # the expert mesh's dimensions (distributed/ep.py)


def expert_mesh(device_type: str, world_size: int, expert_parallel: int):
    """The mesh of the routed experts under expert parallelism: (efsdp, ep, etp). Rank r holds the experts of slot
    r % ep: an expert-parallel group is `ep` consecutive ranks (one node where ep divides a node's processes: the
    all-to-all stays on its links), and the world / ep ranks that hold the same experts (efsdp) shard them with FSDP2.
    etp has size 1: transformers' dispatch takes the group of ranks that share a batch (none here: every rank is
    data-parallel). Made once per process."""
    if world_size % expert_parallel:
        raise ValueError(f"world size {world_size} is not divisible by expert_parallel {expert_parallel}")
    shape = (world_size // expert_parallel, expert_parallel, 1)
    key = (device_type, EP, shape)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        # GPUs: device_type "cuda"; the groups are split from the default "cpu:gloo,cuda:nccl" group, so the
        # all-to-all of CUDA hidden states goes over NCCL (gloo serves it on CPUs: measured, uneven splits too)
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=(EFSDP, EP, ETP))
    return _MESHES[key]


def shard_mesh(mesh):
    """The sub-mesh FSDP2 shards over: dp, or dp and cp flattened into one dimension where cp > 1."""
    if mesh[CP].size() == 1:
        return mesh[DP]
    return mesh[DP, CP]._flatten(f"{DP}_{CP}")
