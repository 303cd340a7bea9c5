"""Model creation per backend, and what the training loop calls on a wrapped model, the same for every backend.

`create_model` (and `create_reference` for a frozen DPO/GRPO reference) builds the model as `plan.loading`
says: whole on every rank (replica), on the meta device then sharded and filled (meta, FSDP2), or
partitioned while constructed (ZeRO-3). `build` wraps it and gives it its optimizer and schedule.
An `Engine` holds the wrapped model, its optimizer and schedule, and answers: `local(batch)` (this rank's part of a
micro-batch: its share of each sequence under context parallelism, cp.py), `accumulating(last)` around
each micro-batch, `backward(loss)`, `step()` once per optimizer step (clip, update, schedule, zero the
gradients; returns the gradient norm), `generation()` around sampling (with `synced_generation`: whether
generate() needs synced_gpus=True), and `full_state_dict()` (a collective) for the final weights.
An engine owns its checkpoint format (`format`): `save`/`load` write and read what is inside a checkpoint
folder, and `read_trained` reads a checkpoint's trained tensors in one process (ft consolidate);
checkpoint.py only names, completes and rotates the folders.
`TorchEngine` serves single-process, DDP and FSDP2 jobs; `deepspeed.ZeroEngine` DeepSpeed ZeRO.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from finetune.compile import compile_layers, failures_explained
from finetune.distributed import cp, ddp, deepspeed, fsdp
from finetune.errors import FtError

FORMAT = "dcp"  # TorchEngine's checkpoint format: one torch.distributed.checkpoint folder, whatever the backend
_FOLDER = "dcp"  # inside a checkpoint folder


@runtime_checkable
class Engine(Protocol):
    """What the training loop, generation and checkpoints call on a wrapped model, whatever the backend."""

    model: Any  # the model as the backend wrapped it: what forward passes run on
    optimizer: Any
    scheduler: Any
    format: str  # the checkpoint format `save` writes and `load` reads (recorded in each checkpoint's state.json)
    gathers_parameters: bool  # a forward pass needs every rank

    @property
    def inner(self) -> Any:
        """The model without its data-parallel wrapper."""

    @property
    def synced_generation(self) -> bool:
        """generate() must run with synced_gpus=True."""

    def accumulating(self, last: bool) -> contextlib.AbstractContextManager: ...

    def local(self, batch: dict) -> dict:
        """This rank's part of a micro-batch (context parallelism: its share of each sequence); the batch itself
        otherwise. Called on every micro-batch before its trained tokens are counted."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> float: ...

    def lr(self) -> float: ...

    def generation(self) -> contextlib.AbstractContextManager: ...

    def full_state_dict(self, trainable_only: bool, dtype=None) -> dict | None:
        """Gathered weights on rank 0 (floating tensors in `dtype`, None: as they are), {} on other ranks; None where
        the model is whole on every rank (rank 0 saves its own copy)."""

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole, one at a time, on every rank (a collective per parameter where sharded: all ranks
        iterate together, and no rank ever holds more than one gathered parameter), under each of its names (a tied
        output head is sent as itself: vLLM reloads it as its own layer). For a rollout engine's weights."""

    def save(self, path: Path, runtime) -> None:
        """Called on every rank: write the model's trained parameters and the optimizer state into checkpoint folder
        `path` (the folder exists; the checkpoint protocol adds the schedule, RNG and state.json)."""

    def load(self, path: Path, runtime) -> None:
        """Called on every rank: restore what `save` wrote into the model and optimizer."""


class TorchEngine:
    """torch's optimizer, clipping and (fp16) loss scaling around a plain, DDP or FSDP2 model."""

    def __init__(
        self,
        model,
        optimizer,
        scheduler,
        max_grad_norm: float,
        fp16: bool,
        device: torch.device,
        plan=None,
        context=None,
    ):
        """`plan`: the job's Plan (its memory savers, expert parallelism, generation mode); None for a plain model
        stepped as it is (a test's, a benchmark's). `context`: a cp.ContextParallel where plan.context_parallel > 1."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_grad_norm = max_grad_norm
        self.scaler = torch.amp.GradScaler(device.type) if fp16 else None
        self.sharded = fsdp.is_sharded(model)  # FSDP2: every rank holds shards
        self.gathers_parameters = self.sharded  # a forward pass needs every rank
        self.context = context
        self.in_backward = hasattr(optimizer, "optimizers")  # an optim.OptimizerInBackward (plan.optimizer_in_backward)
        self.compiled = bool(plan and plan.compile)  # the decoder layers compile on their first call
        self.expert_parallel = plan.expert_parallel if plan else 1  # every forward exchanges tokens between ranks
        self.reshard_after_forward = not plan or plan.sharding != "shard_grad_op"
        self.generation_mode = plan.generation if plan else ("gather" if self.sharded else "local")
        # full fine-tuning under FSDP: skipping sync would keep a whole fp32 gradient of the model per rank; an
        # adapter's is small (memory.py counts it)
        self.sync_every_micro_batch = bool(plan and plan.backend == "fsdp" and plan.adapter == "full")

    @property
    def synced_generation(self) -> bool:
        """generate() must run with synced_gpus=True: sharded parameters are all-gathered layer by layer in every
        forward, so a rank that finished sampling keeps stepping until all have (transformers
        GenerationMixin._has_unfinished_sequences). Under expert parallelism every forward pass is an all-to-all between
        the ranks, gathered or not: they step together too."""
        return self.sharded and (self.generation_mode == "layerwise" or self.expert_parallel > 1)

    @property
    def inner(self):
        """The model without its data-parallel wrapper."""
        return ddp.unwrap(self.model)

    def accumulating(self, last: bool):
        """Synchronise gradients only after the last micro-batch of a step (and, with compiled layers, explain a failure
        to compile them: torch compiles on first use, inside a micro-batch). Under context parallelism the block's
        forward and backward passes run torch's ring attention (cp.ContextParallel.attention)."""
        if self.sharded:
            context = fsdp.accumulating(self.model, last, self.sync_every_micro_batch)
        else:
            context = ddp.accumulating(self.model, last)
        if self.context is not None:
            context = _both(context, self.context.attention())
        return failures_explained(context) if self.compiled else context

    def local(self, batch: dict) -> dict:
        return self.context.local(batch) if self.context is not None else batch

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self):
        """Clip, update, schedule, zero the gradients; returns the gradient norm before clipping (a float, or a 0-dim
        tensor the loop reads together with the loss)."""
        if self.in_backward:  # every parameter was updated, and its gradient freed, in the backward pass
            self.optimizer.step()  # nothing to do; the schedule counts it
            self.scheduler.step()
            return self.optimizer.grad_norm()  # summed by the hooks from each gradient before it was freed
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = clip_gradients([p for p in self.model.parameters() if p.requires_grad], self.max_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        # DDP: zeroed in place, gradients stay views of its buckets (ddp.py); otherwise freed until the next backward
        self.optimizer.zero_grad(set_to_none=not ddp.zero_in_place(self.model))
        return norm

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    @contextlib.contextmanager
    def generation(self):
        """Around a generate() call, per plan.generation: `gather` keeps every parameter whole for the call (no
        collectives inside it, so ranks may sample different lengths); `layerwise` gathers nothing up front (each
        forward all-gathers layer by layer; callers pass synced_gpus=True); `local`: the model is whole already.
        Compiled layers run eagerly inside it: each decoding step's KV cache would add its own recompiles (transformers'
        cache guards differ per layer), soon past torch's recompile limit, after which the training steps too would run
        uncompiled."""
        with contextlib.ExitStack() as stack:
            if self.sharded and self.generation_mode == "gather":
                stack.enter_context(fsdp.unsharded(self.model, self.reshard_after_forward))
            if self.compiled:
                stack.enter_context(torch.compiler.set_stance("force_eager"))
            yield

    format = FORMAT

    def save(self, path: Path, runtime) -> None:
        """Every rank writes its part (FSDP2: its shards; DDP: DCP writes each replicated tensor once)."""
        save_dcp(path, self.model, *self._optimizers())

    def load(self, path: Path, runtime) -> None:
        optimizers, lrs = self._optimizers()
        load_dcp(path, self.model, optimizers, lrs)
        for group, lr in zip(self.optimizer.param_groups, lrs.tolist() if lrs is not None else (), strict=False):
            group["lr"] = lr

    def _optimizers(self):
        """What torch's get_state_dict reads: the optimizer; for a step in backward, its per-parameter optimizers and
        (as a tensor) the lr of each group of the wrapper, which the schedule drives and they read."""
        if not self.in_backward:
            return self.optimizer, None
        lrs = torch.tensor([g["lr"] for g in self.optimizer.param_groups], dtype=torch.float64)
        return list(self.optimizer.optimizers.values()), lrs

    def full_state_dict(self, trainable_only: bool, dtype=None) -> dict | None:
        """Gathered weights on rank 0 for a sharded model; None when the model is whole on every rank."""
        return fsdp.full_state_dict(self.model, trainable_only, dtype) if self.sharded else None

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.inner.named_parameters(remove_duplicate=False):
            whole = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()  # FSDP2: all-gather
            yield name, whole
            del whole


def build(
    model, plan, train, deepspeed_config: dict | None, device: torch.device, total_steps: int, summed_loss: bool = False
):
    """Wrap the model per the plan's backend and give it its optimizer and schedule (the only place that looks at
    plan.backend). `deepspeed_config`: the run folder's deepspeed.json, where DeepSpeed runs; `summed_loss`: the
    method section's, which context parallelism needs."""
    from finetune.optim import build_scheduler

    if plan.backend == "deepspeed":
        return deepspeed.wrap(model, plan, train, deepspeed_config, total_steps)
    # None unless plan.context_parallel > 1; refuses what cannot run
    context = cp.for_plan(plan, model, device, summed_loss)
    if plan.compile:  # in place, before DDP wraps the model; FSDP2's units are these layers (see finetune/compile.py)
        compile_layers(model)
    if plan.backend == "ddp":
        # a vision-language model's trained vision side (projector, tower, cross-attention layers) gets no gradient from
        # a micro-batch without images
        model = ddp.wrap(model, device, unused=plan.vision and plan.image_free_rows)
    elif plan.backend == "fsdp":
        model = fsdp.wrap_planned(model, plan, device)
    optimizer = make_optimizer(model, plan, train)  # after sharding: FSDP2 parameters are DTensors
    scheduler = build_scheduler(optimizer, train, total_steps)
    fp16 = plan.precision == "fp16"
    return TorchEngine(model, optimizer, scheduler, train.max_grad_norm, fp16, device, plan, context)


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


def make_optimizer(model, plan, train):
    """The optimizer train.optimizer names, over bf16 weights under plan.pure_bf16 (optim.CompensatedAdamW, with
    plan.compensation); under plan.optimizer_in_backward one per parameter, stepped by hooks in the backward pass
    (optim.OptimizerInBackward)."""
    from finetune.optim import OptimizerInBackward, optimizer_factory, param_groups

    make = optimizer_factory(train, plan.lr, plan.pure_bf16, plan.compensation)
    groups = param_groups(model, train.weight_decay)
    return OptimizerInBackward(model, groups, make, plan.lr) if plan.optimizer_in_backward else make(groups, 0)


def check_savers(plan, train, samples: bool = False) -> None:
    """Refuse a plan whose memory savers this backend cannot run as asked (the planner never makes one; a plan.json
    edited by hand could). `samples`: the method samples during training (its section's generation_tokens)."""
    problems = []
    if plan.pure_bf16 and plan.precision != "bf16":
        problems.append(
            f"train.precision: bf16-pure computes in bf16, but the plan's precision is {plan.precision}; plan the job "
            "again (ft train writes plan.json) instead of editing plan.json"
        )
    if plan.pure_bf16 and plan.backend == "deepspeed":
        problems.append(
            "train.precision: bf16-pure cannot run under DeepSpeed, whose bf16 mode keeps fp32 master weights and "
            "optimizer states by design; use distributed.backend: fsdp (or single / ddp), or train.precision: bf16"
        )
    if plan.compile and plan.backend == "deepspeed":
        problems.append(
            "train.compile: ft compiles the models it wraps itself, not under DeepSpeed; plan the job again with "
            "train.compile: false (ft train writes plan.json) instead of editing plan.json"
        )
    if plan.optimizer_in_backward:
        needs = {
            "one process (distributed.backend: single)": plan.backend == "single" and plan.world_size == 1,
            "no gradient accumulation (train.global_batch_size equal to train.micro_batch_size)": (
                plan.gradient_accumulation_steps == 1
            ),
            "no clipping (train.max_grad_norm: 0)": train.max_grad_norm == 0,
            "no fp16 loss scaling (train.precision bf16 or fp32)": plan.precision != "fp16",
        }
        unmet = [need for need, met in needs.items() if not met]
        if unmet:
            problems.append(
                f"train.optimizer_in_backward needs {'; '.join(unmet)}; set those, or train.optimizer_in_backward: "
                "false"
            )
    if plan.tensor_parallel > 1:  # the model's own layout is checked where its layers are split (tp.parallelize)
        from finetune.config.parallel_checks import tensor_parallel_problems

        problems += tensor_parallel_problems(
            None,
            plan.tensor_parallel,
            backend=plan.backend,
            quantization=plan.quantization,
            processes_per_node=plan.processes_per_node,
            world_size=plan.world_size,
            sharding=plan.sharding,
            samples=samples,
            stochastic_rounding=plan.pure_bf16 and plan.compensation == "stochastic_rounding",
        )
    if plan.expert_parallel > 1:  # the model itself is checked where its experts are split (ep.parallelize)
        from finetune.config.parallel_checks import expert_parallel_problems

        problems += expert_parallel_problems(
            None,
            plan.expert_parallel,
            backend=plan.backend,
            world_size=plan.world_size,
            quantization=plan.quantization,
            tensor_parallel=plan.tensor_parallel,
            context_parallel=plan.context_parallel,
            sharding=plan.sharding,
            offload=plan.offload,
            samples=samples,
            compile=plan.compile,
        )
    if problems:
        raise FtError("this plan cannot run: " + ". ".join(problems))


def clip_gradients(params, max_norm: float):
    """Scale the gradients down so that their global L2 norm is at most max_norm (0: no clipping); returns the norm
    before clipping, a 0-dim tensor on the gradients' device: nothing here waits for the device (the training loop
    reads the norm with the loss, once per step). Sharded (DTensor) gradients: torch's norm is a partial DTensor whose
    full_tensor() all-reduces the per-rank sums on the device the shards live on: the GPU (NCCL), or the CPU under FSDP
    CPU offload, which the process group serves with gloo ("cpu:gloo,cuda:nccl", runtime.py; torch
    distributed/tensor/_redistribute.py reduces the local tensor where it is). The scaling multiplies each rank's local
    shard by the clamped coefficient, moved to that shard's device."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = _global_norm(grads)
    if max_norm > 0:
        # in float64, then fp32 (the math dtype of fp32/bf16/fp16 gradients): the value a Python float gives, so
        # clipping rounds as it did when the norm was read on the host; 1 under the limit, an exact no-op
        coefficient = torch.clamp(max_norm / (norm.double() + 1e-6), max=1.0).float()
        groups: dict = {}  # one fused multiply per device and dtype, as torch's own clip_grads_with_norm_ does
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g
            groups.setdefault((local.device, local.dtype), []).append(local)
        with torch.no_grad():
            for (device, _), locals_ in groups.items():
                torch._foreach_mul_(locals_, coefficient.to(device, non_blocking=True))
    return norm


def _global_norm(grads: list) -> torch.Tensor:
    """The L2 norm of all gradients together, as a 0-dim tensor. Under tensor parallelism the DTensor gradients live on
    different meshes (a decoder layer's on the 2-D dp × tp mesh, the embeddings' and output head's on the dp mesh
    alone), which one torch norm cannot combine: each mesh's norm is made whole on its own (full_tensor() reduces its
    partial sums over that mesh's shard dimensions only; replicated dimensions hold equal values, so nothing is counted
    twice), then the squares are added."""
    groups: dict = {}  # in the same order on every rank (the model's parameter order): the reductions pair up
    for g in grads:
        groups.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    return torch.stack([n.to(device, torch.float64) for n in norms]).square().sum().sqrt()


# ---------------------------------------------------------------- the checkpoint format
def _dcp_state(model, optimizers, lrs: torch.Tensor | None) -> dict:
    """What a checkpoint folder's DCP holds, through torch's get_state_dict (by the unwrapped model's names): the model
    state dict's trained entries (a checkpoint never holds the frozen base; every trained parameter is one of them),
    the optimizer state, and `lrs` where given."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizers)
    names = {n for n, p in ddp.unwrap(model).named_parameters() if p.requires_grad}
    if not names <= set(model_sd):
        raise FtError(f"a bug in ft: trained parameters {sorted(names - set(model_sd))[:3]} are not in the state dict")
    trained = {k: v for k, v in model_sd.items() if k in names}
    return {"model": trained, "optim": optim_sd} | ({"lr": lrs} if lrs is not None else {})


def save_dcp(folder: Path, model, optimizers, lrs: torch.Tensor | None = None) -> None:
    """Every rank writes its part of the trainable parameters and optimizer state into checkpoint `folder` (DCP,
    through torch's get_state_dict: the names are the unwrapped model's, for a plain, DDP or FSDP2 model). `lrs`: the
    groups' learning rates where the optimizers do not hold them (a step in backward)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(model, optimizers, lrs), checkpoint_id=str(folder / _FOLDER))


def load_dcp(folder: Path, model, optimizers, lrs: torch.Tensor | None = None) -> None:
    """Every rank reads its part back from checkpoint `folder` (and `lrs` in place); DCP reshards when the ranks are
    laid out anew."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _dcp_state(model, optimizers, lrs)
    _check_matches(folder, state)
    dcp.load(state, checkpoint_id=str(folder / _FOLDER))
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=False),
    )


def _check_matches(folder: Path, state: dict) -> None:
    """Refuse, with the reason, a checkpoint that does not hold what `state` asks for: other trained parameters (the
    config changed), or an optimizer stepped in backward where this job steps after it (or the other way round)."""
    from torch.distributed.checkpoint import FileSystemReader

    written = FileSystemReader(str(folder / _FOLDER)).read_metadata().state_dict_metadata
    trained = {k.removeprefix("model.") for k in written if k.startswith("model.")}
    expected = set(state["model"])
    if trained != expected:
        missing, extra = sorted(expected - trained)[:3], sorted(trained - expected)[:3]
        raise FtError(
            f"checkpoint {folder} does not match this model (missing {missing}, unexpected {extra}); was the "
            "config changed since it was written? Resume with the same config, or start a new output.dir"
        )
    if ("lr" in written) != ("lr" in state):
        how = "a step in backward" if "lr" in written else "a step after the backward pass"
        raise FtError(
            f"checkpoint {folder} holds the optimizer state of {how} (train.optimizer_in_backward) and this job "
            "steps the other way; resume with the optimizer_in_backward setting the run was written with"
        )


def read_trained(path: Path, fmt: str, model) -> dict:
    """The trained parameters of checkpoint folder `path`, written in format `fmt` by any number of ranks, as whole CPU
    tensors by the names of `model`'s parameters (`model`: built whole in this one process, no process group)."""
    import torch.distributed.checkpoint as dcp

    if fmt == deepspeed.FORMAT:
        return deepspeed.read_trained(path, model)
    if fmt != FORMAT:
        earlier = _EARLIER if fmt == _SINGLE_COPY else ""
        raise FtError(
            f"checkpoint {path} records the format {fmt!r}, which this version of ft cannot read (it reads {FORMAT} "
            f"and {deepspeed.FORMAT}{earlier}); use the ft version that wrote it"
        )
    state = {"model": {n: torch.empty_like(p) for n, p in model.named_parameters() if p.requires_grad}}
    dcp.load(state, checkpoint_id=str(path / _FOLDER), no_dist=True)
    return state["model"]


_SINGLE_COPY = "single"  # the format development versions of ft 0.1 wrote for a model whole on every rank
_EARLIER = "; 'single' was written by a development version of ft before one format served every torch backend"


@dataclass(frozen=True)
class ModelSpec:
    """What creating a rank's model reads: the job's config (its model, adapter and train sections, the seed), the
    Plan, the tokenizer (its length sizes the embeddings), the attention kernel, this rank's device and, where
    DeepSpeed runs, the configuration the run folder holds (deepspeed.json)."""

    config: Any
    plan: Any
    tokenizer: Any
    attn: str
    device: torch.device
    deepspeed: dict | None = None

    def pieces(self) -> tuple:
        """(model, adapter, plan, tokenizer, attn, device, seed): what every way of creating the model takes."""
        c = self.config
        return c.model, c.adapter, self.plan, self.tokenizer, self.attn, self.device, c.train.seed


def create_model(spec: ModelSpec):
    """The model this rank trains, ready for `build`, created as plan.loading says: `replica` loads it whole (4/8-bit
    bases quantized while loading), `meta` builds it sharded (FSDP2: fsdp.create_model), `partitioned` constructs it
    partitioned (DeepSpeed ZeRO-3). Adapters start from the same values in every path (adapters.initial_value)."""
    plan, seed = spec.plan, spec.config.train.seed
    check_savers(plan, spec.config.train, bool(spec.config.method.generation_tokens(plan.seq_len)))
    if plan.loading == "partitioned":
        model = deepspeed.create_model(*spec.pieces(), spec.deepspeed)
    elif plan.loading == "meta":
        model = fsdp.create_model(*spec.pieces())
    else:
        model = _replica(*spec.pieces())
    torch.manual_seed(seed)  # the same random stream after creation, however the model was built
    return model


def create_reference(spec: ModelSpec):
    """A frozen copy of the starting model (the DPO/GRPO reference when plan.reference is "copy"), in the plan's compute
    precision, and sharded like the policy where the policy is."""
    plan = spec.plan
    if plan.loading == "partitioned":
        return deepspeed.create_reference(*spec.pieces(), spec.deepspeed)
    if plan.loading == "meta":
        return fsdp.create_model(*spec.pieces(), frozen=True).eval()
    from finetune.models import load_model

    copy = load_model(spec.config.model, plan, spec.tokenizer, spec.attn, dtype=plan.precision)
    if plan.quantization == "none" or plan.loading == "host":  # host: quantized in host RAM, whole to the GPU
        copy.to(spec.device)
    return copy.requires_grad_(False).eval()


def _replica(model_section, adapter_section, plan, tokenizer, attn: str, device: torch.device, seed: int):
    from finetune.adapters import apply_adapter, init_adapter
    from finetune.models import load_model

    model = apply_adapter(load_model(model_section, plan, tokenizer, attn, seed=seed), adapter_section, plan)
    init_adapter(model, seed)
    if plan.quantization == "none":  # bitsandbytes weights stay where from_pretrained's device_map quantized them
        model.to(device)
    return model
