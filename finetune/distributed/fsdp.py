"""FSDP2 (`fully_shard`): parameters, gradients and optimizer states sharded over ranks.

Each decoder layer is one unit (its parameters are all-gathered just before use and freed after), its attention and
its largest matrices units of their own inside it (`pieces`), then the root; the embeddings and the output head stay
sharded by vocabulary rows, walked a chunk at a time (distributed/vocab.py), or where that cannot apply are units of
their own (unless tied). `shard_grad_op` keeps the gathered parameters from
forward to backward; `hybrid_shard` shards inside a node and replicates across nodes (a 2-D device mesh). Mixed
precision computes in the plan's half precision and reduces gradients in fp32. Checkpoints are engine.py's: every
rank writes its shards into one torch.distributed.checkpoint folder.

`create_model` builds the model on the meta device, applies the adapter, shards it, then allocates each
rank's shards and fills them from the safetensors files, each rank reading only its own rows of each
tensor: no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import re

import torch

from finetune.distributed import ep, tp, vocab
from finetune.distributed import mesh as meshes


def decoder_layers(model) -> list:
    """The repeated blocks to shard one by one: modules whose class transformers marks as not to be split."""
    names = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError("found no decoder layers to shard (no _no_split_modules on the model)")
    return layers


def wrap(
    model,
    precision: str,
    sharding: str,
    nodes: int,
    per_node: int,
    device: torch.device,
    offload: bool = False,
    tensor_parallel: int = 1,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    head_unit: bool = True,
    vocab_rows: bool = True,
    split_layers: bool = True,
):
    """fully_shard each decoder layer, then the root; the embeddings and the output head split by vocabulary rows
    (distributed/vocab.py; `vocab_rows` false, or where it cannot apply: units of their own, `ends`). A model that
    `create_model` already sharded is returned as it is.
    With tensor (or context) parallelism the ranks form a (dp, cp, tp) mesh (distributed/mesh.py): each decoder layer
    is first split over tp (distributed/tp.py), then FSDP2 shards every parameter over the dp (× cp) sub-mesh. With
    expert parallelism the routed experts are split over ep ranks first and each experts module is its own unit over
    the ranks that hold the same experts (distributed/ep.py); the rest is sharded over all ranks. `split_layers`: on
    a 1-D or hybrid mesh without expert parallelism, the large parts of each layer are units inside its unit
    (`pieces`); false for layers torch.compile compiles whole (each inner unit's hooks would break the graph)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    if is_sharded(model):
        return model
    kwargs = {}
    if precision in ("bf16", "fp16"):
        half = torch.bfloat16 if precision == "bf16" else torch.float16
        # Pure bf16 (plan.pure_bf16) uses the same policy: the sharded parameters are bf16 already, so param_dtype
        # casts nothing, and gradients are still reduce-scattered in fp32, then cast to the parameter's bf16 (torch
        # _fsdp_param.init_dtype_attrs, _fsdp_collectives.foreach_reduce): the sum over ranks is rounded to bf16 once
        # instead of at every hop of the ring, for one unit's gradients transiently in fp32 and twice the
        # reduce-scatter bytes. Nothing persistent is fp32.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    grid = meshes.device_mesh(device.type, nodes * per_node, tensor_parallel, context_parallel)
    if grid is not None:
        if tensor_parallel > 1:
            tp.parallelize(model, grid[meshes.TP], layers)
        kwargs["mesh"] = meshes.shard_mesh(grid)
    elif sharding == "hybrid_shard":
        kwargs["mesh"] = init_device_mesh(device.type, (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    reshard = sharding != "shard_grad_op"
    if expert_parallel > 1:
        experts = meshes.expert_mesh(device.type, nodes * per_node, expert_parallel)
        split = ep.parallelize(runner(model), experts)
        ep.shard(split, experts, nodes * per_node, reshard_after_forward=reshard, **kwargs)
    plain_mesh = grid is None and sharding != "hybrid_shard" and not offload and expert_parallel == 1
    rows = vocab.shardable(runner(model), head_unit) if vocab_rows and plain_mesh else []
    ignored = set()
    if rows:  # the ends split by vocabulary rows, never gathered whole (distributed/vocab.py)
        kwargs.setdefault("mesh", init_device_mesh(device.type, (nodes * per_node,)))
        budget = max(sum(p.numel() for p in layer.parameters()) for layer in layers) // 2
        ignored = vocab.shard(
            rows, kwargs["mesh"], budget, kwargs["mp_policy"].param_dtype if "mp_policy" in kwargs else None
        )
    inner = (
        [p for layer in layers for p in pieces(layer)] if split_layers and grid is None and expert_parallel == 1 else []
    )
    for unit in (*inner, *layers, *(m for m in ends(model, head_unit) if m not in rows)):
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
    fully_shard(runner(model), reshard_after_forward=reshard, ignored_params=ignored or None, **kwargs)
    if device.type == "cpu":  # gloo's all-gather stages a second copy of each unit (vocab.gather_rows)
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_custom_all_gather(vocab.CpuAllGather())
    return model


def pieces(layer) -> list:
    """The parts of a decoder layer sharded as units of their own inside the layer's unit, so that a rank holds one
    part gathered at a time (with its all-gather buffer beside it while it is copied out) instead of the whole layer:
    each child module no larger than the layer's largest matrix (x1.25, for an adapter's or a bias's extra parameters)
    and not much smaller (at least 1/8 of it; norms and routers stay in the layer's unit), descending into larger
    children made of smaller modules. A Llama layer: its attention, then gate, up and down projections, each a
    quarter of the layer; an MoE layer: its experts module (whose fused expert tensors are its own parameters), with
    the attention if not far smaller. FSDP2 nests units (torch 2.13 fully_shard: a unit manages the parameters no inner
    unit took); under activation checkpointing the recomputed forward gathers each part again, as it gathers layers."""
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in layer.modules()]
    most = 1.25 * max(own, default=0)
    found = []

    def walk(module):
        for child in module.children():
            size = sum(p.numel() for p in child.parameters())
            container = type(child).forward is torch.nn.Module.forward  # a ModuleDict or ModuleList: not a unit
            # a matrix with its own parameters, or an adapter around one (peft's layers hold a `base_layer`): whole
            whole = hasattr(child, "base_layer") or size == sum(p.numel() for p in child.parameters(recurse=False))
            if container or (size > most and not whole):
                walk(child)
            elif size * 8 >= most:
                found.append(child)

    walk(layer)
    return found


def ends(model, head: bool = True) -> list:
    """The input embeddings and the output head, each sharded as a unit of its own (as torchtitan shards them), so that
    they are gathered only while they run. In the root unit they would be whole through each pass: the root is gathered
    before the first layer's forward and resharded after the head's, then gathered again by the first gradient of the
    backward pass (the head's) and resharded by the final callback after the embeddings' (torch 2.13
    _fsdp_param_group.py pre_backward, _fsdp_state.py _root_post_backward_final_callback): 2 GiB per rank for an 8B
    model with a 128k vocabulary. None when they share a parameter (tied): such a table is needed at both ends of each
    pass and stays in the root unit; a model without a head (a sequence classifier) shards its embeddings alone.
    `head` false (a loss that runs the head outside the forward pass, chunk by chunk: methods/head.py) keeps the head
    in the root: as a unit of its own it would be gathered again for every chunk, forward and backward (each chunk's
    post-backward reshards it: _fsdp_param_group.py post_backward)."""
    lm = runner(model)
    embeddings, output = lm.get_input_embeddings(), lm.get_output_embeddings()
    if output is not None and {id(p) for p in embeddings.parameters()} & {id(p) for p in output.parameters()}:
        return []
    return [m for m in (embeddings, output if head else None) if m is not None]


def wrap_planned(model, plan, device: torch.device):
    """`wrap` with the plan's precision, sharding, topology, offload, tensor/context/expert-parallel degrees and loss
    (the head is a unit of its own under the plain loss: `ends`)."""
    return wrap(
        model,
        plan.precision,
        plan.sharding,
        plan.nodes,
        plan.processes_per_node,
        device,
        offload=plan.offload == "all",
        tensor_parallel=plan.tensor_parallel,
        context_parallel=plan.context_parallel,
        expert_parallel=plan.expert_parallel,
        head_unit=plan.loss_implementation == "plain",
        split_layers=not plan.compile,
    )


def runner(model):
    """The module whose forward both training and generate() go through, made FSDP's root: the transformers
    model itself (under a peft wrapper, whose generate() bypasses the wrapper's own forward)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def root(model):
    """The outermost FSDP unit, or None for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


def accumulating(model, last: bool, every_micro_batch: bool = False):
    """Reduce-scatter gradients after the last micro-batch of a step, or after every one (`every_micro_batch`): without
    sync FSDP2 keeps each parameter's whole gradient, upcast to fp32, until the step's last backward
    (torch _fsdp_param_group.post_backward -> FSDPParam.to_accumulated_grad_if_needed)."""
    unit = root(model)
    if unit is not None:
        unit.set_requires_gradient_sync(last or every_micro_batch)
    return contextlib.nullcontext()


@contextlib.contextmanager
def unsharded(model, reshard_after_forward: bool):
    """Every FSDP unit all-gathered once and kept whole until the block ends (no collectives inside it), the
    row-sharded ends too (vocab.whole)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    with vocab.whole(model):
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


def full_state_dict(model, trainable_only: bool, dtype=None) -> dict:
    """The whole (unsharded) state dict on rank 0, on CPU, floating tensors in `dtype` (as they are: None); other ranks
    get {}. Gathered one tensor at a time and cast on the device before the copy to the host (artifacts/weights.py
    saved_tensor): rank 0 never holds a whole model in another dtype. With `trainable_only` only the trained
    parameters are gathered (an adapter: the frozen base is never all-gathered). A tied tensor is gathered once."""
    from finetune.artifacts.weights import saved_tensor

    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if trainable_only:
        tensors = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    else:
        tensors = list(model.state_dict(keep_vars=True).items())
    out, done = {}, {}
    for name, t in tensors:
        if id(t) not in done:  # every rank takes part in each all-gather, and skips the same tied names
            whole = t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()
            done[id(t)] = saved_tensor(whole, dtype, copy=True) if rank0 else None
            del whole
        if rank0:
            out[name] = done[id(t)]
    return out


# ---------------------------------------------------------------- building sharded: meta -> fully_shard -> fill
def create_model(
    model_section, adapter_section, plan, tokenizer, attn: str, device: torch.device, seed: int, frozen: bool = False
):
    """The model built on the meta device (adapter included), sharded with `wrap`, then this rank's shards allocated and
    filled from the safetensors files. `frozen`: a reference copy in the compute precision, nothing trainable."""
    from finetune import adapters, models

    ckpt = models.Checkpoint(models.weights_folder(model_section))
    net = models.build_empty(
        model_section, plan, tokenizer, attn, plan.precision if frozen else models.load_dtype(model_section, plan)
    )
    keys = models.checkpoint_keys(net, ckpt)
    model = net.requires_grad_(False) if frozen else adapters.apply_adapter(net, adapter_section, plan)
    sources = _sources(model, keys)
    buffers = {name: keys[id(b)] for name, b in net.named_buffers() if id(b) in keys}
    wrap_planned(model, plan, device)
    # CPU offload keeps the shards in pinned host memory: allocate them there, never on the GPU (torch fully_shard
    # CPUOffloadPolicy: FSDPParam.reset_sharded_param pins CPU shards, which FSDPModule._apply calls after to_empty)
    model.to_empty(device=torch.device("cpu") if plan.offload == "all" else device)
    models.init_buffers(net)
    _fill(model, sources, ckpt, seed)
    with torch.no_grad():
        for name, key in buffers.items():
            net.get_buffer(name).copy_(ckpt.read(key).view(net.get_buffer(name).shape))
    return model


def _sources(model, keys: dict[int, str]) -> dict[str, str | None]:
    """Each parameter's checkpoint tensor, by name; None for adapter tensors (they start from adapters.initial_value).
    peft's
    trainable copy of a module (modules_to_save) starts as the original module, so it reads the original's tensor."""
    every = dict(model.named_parameters(remove_duplicate=False))  # a tied original is listed under each of its names
    out = {}
    for name, p in model.named_parameters():
        twin = every.get(re.sub(r"\.modules_to_save\.[^.]+\.", ".original_module.", name))
        out[name] = keys.get(id(p)) or (keys.get(id(twin)) if twin is not None else None)
    return out


def local_rows(p) -> tuple[torch.Tensor, int]:
    """This rank's part of parameter `p` and the index of its first row in the whole tensor. FSDP2 splits dim 0 into
    torch.chunk pieces over the mesh's shard dimension (torch _fsdp_param._init_sharded_param); other dims replicate."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return p.data, 0
    shards = [(dim, s) for dim, s in enumerate(p.placements) if isinstance(s, Shard)]
    if len(shards) != 1 or shards[0][1].dim != 0:
        raise ValueError(f"unexpected FSDP placement {p.placements} for a parameter of shape {tuple(p.shape)}")
    dim = shards[0][0]
    chunk = -(-p.shape[0] // p.device_mesh.size(dim))
    start = min(p.device_mesh.get_local_rank(dim) * chunk, p.shape[0])
    # under no_grad: the shard's own storage (DTensor.to_local), so writes land in FSDP's shard
    return p.to_local(), start


def local_box(p) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of parameter `p` (its own storage, under no_grad) and the index in the whole tensor of its first
    element along each dimension. FSDP2 splits dim 0 into torch.chunk pieces over the shard mesh; under tensor
    parallelism the tp dimension splits dim 0 (column-wise) or dim 1 (row-wise) first, and FSDP2's pieces are chunks of
    that block (torch _fsdp_param: _StridedShard), so the part is one box of the whole tensor: torch's
    compute_local_shape_and_global_offset (what DCP uses) gives its corner."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return p.data, (0,) * p.ndim
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if tuple(shape) != tuple(local.shape):
        raise ValueError(f"unexpected placement {p.placements} for a parameter of shape {tuple(p.shape)}")
    return local, tuple(offset)


def fill_box(ckpt, key: str, offset: tuple[int, ...], out: torch.Tensor) -> None:
    """Fill `out` with the box of checkpoint tensor `key` that starts at `offset`: its rows (models.fill_rows), cut to
    out's columns where tensor parallelism splits dim 1 (one slice of this rank's rows is staged whole)."""
    from finetune import models

    full = ckpt.shape(key) or (1,)
    if out.ndim < 2 or (tuple(out.shape[1:]) == tuple(full[1:]) and not any(offset[1:])):
        models.fill_rows(ckpt, key, offset[0] if offset else 0, out)
        return
    rows = torch.empty((out.shape[0], *full[1:]), dtype=out.dtype)  # host memory; copy_ below moves the box to a GPU
    models.fill_rows(ckpt, key, offset[0], rows)
    out.copy_(rows[(slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:])))])


@torch.no_grad()
def _fill(model, sources: dict[str, str | None], ckpt, seed: int) -> None:
    """Every parameter's local rows: checkpoint rows (read straight into the shard), adapter starting values, and DoRA
    magnitudes last (they are the norms of the base weight's rows, which this rank holds for its own rows)."""
    from finetune import adapters, models

    params = dict(model.named_parameters())
    for name, p in params.items():
        local, offset = local_box(p)
        if local.numel() == 0 or adapters.is_dora_magnitude(name):
            continue
        box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        if sources[name] is not None:
            fill_box(ckpt, sources[name], offset, local)
        elif models.is_new_head(name):
            local.copy_(models.head_value(name, tuple(p.shape), seed, models.head_std(model))[box])
        else:
            local.copy_(adapters.initial_value(name, tuple(p.shape), seed)[box])
    for name, p in params.items():
        if adapters.is_dora_magnitude(name) and p.numel():
            base, _ = local_rows(params[name.split(".lora_magnitude_vector.")[0] + ".base_layer.weight"])
            # lora_B starts at zero: ||W + s·BA|| = ||W||
            local_rows(p)[0].copy_(torch.linalg.norm(base, dim=1).to(base.dtype))
