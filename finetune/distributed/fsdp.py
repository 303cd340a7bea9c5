"""FSDP2 (`fully_shard`): parameters, gradients and optimizer states sharded over ranks.

Each decoder layer is one unit (its parameters are all-gathered just before use and freed after), then
the root. `shard_grad_op` keeps the gathered parameters from forward to backward; `hybrid_shard` shards
inside a node and replicates across nodes (a 2-D device mesh). Mixed precision computes in the plan's
half precision and reduces gradients in fp32. Checkpoints are sharded with torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib

import torch


def decoder_layers(model) -> list:
    """The repeated blocks to shard one by one: modules whose class transformers marks as not to be split."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError("found no decoder layers to shard (no _no_split_modules on the model)")
    return layers


def wrap(model, precision: str, sharding: str, nodes: int, per_node: int, device: torch.device, offload: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if precision in ("bf16", "fp16"):
        half = torch.bfloat16 if precision == "bf16" else torch.float16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if sharding == "hybrid_shard":
        kwargs["mesh"] = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    reshard = sharding != "shard_grad_op"
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard(runner(model), reshard_after_forward=reshard, **kwargs)
    return model


def runner(model):
    """The module whose forward both training and generate() go through, made FSDP's root: the transformers
    model itself (under a peft wrapper, whose generate() bypasses the wrapper's own forward)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def root(model):
    """The outermost FSDP unit, or None for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def accumulating(model, last: bool):
    """Reduce-scatter gradients only after the last micro-batch of a step."""
    unit = root(model)
    if unit is not None:
        unit.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


@contextlib.contextmanager
def unsharded(model, reshard_after_forward: bool):
    """Every FSDP unit all-gathered once and kept whole until the block ends (no collectives inside it)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def is_sharded(model) -> bool:
    return root(model) is not None


def full_state_dict(model, trainable_only: bool) -> dict:
    """The whole (unsharded) state dict on rank 0, on CPU; other ranks get {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainable_only:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in sd.items() if k in names}
    return sd


def save_sharded(path, model, optimizer) -> None:
    """Every rank writes its shards of the trainable parameters and optimizer state (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    dcp.save({"model": {k: v for k, v in model_sd.items() if k in names}, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(path, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    state = {"model": {k: v for k, v in model_sd.items() if k in names}, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=StateDictOptions(strict=False))
