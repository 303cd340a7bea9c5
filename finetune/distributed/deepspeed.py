"""DeepSpeed ZeRO: the JSON ft writes from the plan, the ZeRO-3 model built partitioned, and the engine the training
loop drives.

ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters (gathered layer by layer
in forward and backward). Offload moves optimizer states (and with ZeRO-3 `all`, parameters) to host
RAM, where DeepSpeed's CPU Adam updates them. ft keeps its own loss normalisation and schedule:
gradient accumulation is unmanaged (one `step()` per optimizer step) and the loss is not rescaled.
Under ZeRO-3 `create_model` and `create_reference` construct the models partitioned (deepspeed_load.py), so no
rank holds a whole copy; `wrap` takes such a model as it is.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from finetune.errors import FtError

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
FORMAT = "deepspeed"  # the checkpoint format: DeepSpeed's own layout, every rank's partitions
_FOLDER, _TAG = "deepspeed", "zero"  # inside a checkpoint folder: DeepSpeed's save_dir and tag
_AUTO_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def config_for(plan, train, distributed) -> dict:
    """The DeepSpeed configuration of a planned job; the user's own file (distributed.deepspeed_config) is used
    as written, except that "auto" values are filled from the plan, and refused where DeepSpeed or the plan cannot
    run it (`_check_users_file`)."""
    ours = _from_plan(plan, train)
    if distributed.deepspeed_config is None:
        return ours
    path = Path(distributed.deepspeed_config).expanduser()
    try:
        theirs = json.loads(path.read_text())
    except FileNotFoundError:
        raise FtError(
            f"distributed.deepspeed_config: {path} does not exist; give the path of a DeepSpeed JSON file, or "
            "remove the key to let ft write one"
        ) from None
    except json.JSONDecodeError as e:
        raise FtError(f"distributed.deepspeed_config: {path} line {e.lineno}: not valid JSON ({e.msg})") from None
    for key in _AUTO_KEYS:
        if theirs.get(key) == "auto":
            theirs[key] = ours[key]
    for key in ("bf16", "fp16"):
        if isinstance(theirs.get(key), dict) and theirs[key].get("enabled") == "auto":
            theirs[key]["enabled"] = ours[key]["enabled"]
    theirs["managed_gradient_accumulation"] = False  # ft's loop owns accumulation (see module docstring)
    _check_users_file(theirs, path, plan)
    return theirs


def _check_users_file(config: dict, path: Path, plan) -> None:
    """What a user's DeepSpeed file must agree with: the planned stage (memory was planned for it, and ZeRO-3 models are
    built partitioned), and overlap_comm only from stage 2 (deepspeed 0.19 runtime/engine.py asserts it when the
    training loop owns gradient accumulation, as ft's does)."""
    zero = config.get("zero_optimization", {})
    stage, planned = zero.get("stage", 0), STAGES[plan.sharding] if plan.sharding in STAGES else None
    if planned is not None and stage != planned:
        other = f", or distributed.sharding: zero{stage}" if f"zero{stage}" in STAGES else ""
        raise FtError(
            f"distributed.deepspeed_config: {path} sets zero_optimization.stage {stage}, but the plan is "
            f'{plan.sharding} (distributed.sharding); set "stage": {planned} in the file{other}'
        )
    if zero.get("overlap_comm") is True and stage < 2:
        raise FtError(
            f"distributed.deepspeed_config: {path} sets zero_optimization.overlap_comm true with stage {stage}; "
            "DeepSpeed overlaps communication only from stage 2 when the training loop owns gradient accumulation "
            '(ft\'s does): set "overlap_comm": false, or use stage 2 or 3'
        )


def _from_plan(plan, train) -> dict:
    stage = STAGES[plan.sharding]
    # GPU only, and only from stage 2: with ft's unmanaged accumulation deepspeed 0.19 asserts overlap_comm needs
    # partitioned gradients (runtime/engine.py, "supports ZeRO overlap_comm only with ZeRO stage 2")
    zero: dict = {"stage": stage, "contiguous_gradients": True, "overlap_comm": plan.device == "GPU" and stage >= 2}
    if plan.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offload == "all" and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "managed_gradient_accumulation": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def create_model(model_section, adapter_section, plan, tokenizer, attn, device, seed, config: dict):
    """ZeRO-3: the model to train, constructed partitioned with its adapter (see deepspeed_load.py); `wrap` takes it as
    is. `config`: the run's DeepSpeed configuration (deepspeed.json)."""
    from finetune.distributed.deepspeed_load import partitioned_model

    _require_deepspeed()
    return partitioned_model(model_section, adapter_section, plan, tokenizer, attn, device, seed, config)


def create_reference(model_section, adapter_section, plan, tokenizer, attn, device, seed, config: dict):
    """ZeRO-3: the frozen DPO/GRPO reference, partitioned like the policy, in its own DeepSpeed engine (forward
    only)."""
    from finetune.distributed.deepspeed_load import partitioned_reference

    _require_deepspeed()
    return partitioned_reference(model_section, plan, tokenizer, attn, device, config)


def _require_deepspeed():
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise FtError(
            f"distributed.backend: deepspeed is not installed ({e}); install it with: DS_BUILD_OPS=0 pip install "
            "'finetune[deepspeed]', or choose backend fsdp"
        ) from None


def wrap(model, plan, train, config: dict, total_steps: int) -> ZeroEngine:
    """deepspeed.initialize on the model with ft's optimizer (CPU Adam when offloading) and schedule, per `config` (the
    run's deepspeed.json). A model that create_model built partitioned is taken as it is (DeepSpeed partitions only
    parameters that are not yet)."""
    _require_deepspeed()
    import deepspeed

    from finetune.optim import BETAS, EPS, build_optimizer, build_scheduler, param_groups

    if config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none") not in ("none", None):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(
            param_groups(model, train.weight_decay), lr=plan.lr, betas=BETAS, eps=EPS, adamw_mode=True
        )
    else:
        optimizer = build_optimizer(model, train, plan.lr)
    # ft steps it; DeepSpeed's wrapper shares its param groups
    scheduler = build_scheduler(optimizer, train, total_steps)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return ZeroEngine(engine, scheduler, config, plan.generation)


class ZeroEngine:
    """The training loop's view of a DeepSpeed engine (finetune/distributed/engine.py's `Engine`)."""

    format = FORMAT

    def __init__(self, engine, scheduler, config: dict, generation: str = "gather"):
        self.model, self.scheduler, self.config = engine, scheduler, config  # config: what initialized it
        self.stage = stage = int(config.get("zero_optimization", {}).get("stage", 0))
        self.optimizer = engine.optimizer
        self.gathers_parameters = stage == 3
        # plan.generation
        self.generation_mode = ("layerwise" if generation == "layerwise" else "gather") if stage == 3 else "local"
        # generate() needs synced_gpus=True only where each forward all-gathers layers (layerwise): with every parameter
        # gathered for the call, ZeRO-3's fetch hook gathers nothing (deepspeed 0.19 partitioned_param_coordinator
        # fetch_sub_module fetches only NOT_AVAILABLE parameters), so ranks may stop sampling at different lengths
        self.synced_generation = self.generation_mode == "layerwise"

    @property
    def inner(self):
        return self.model.module

    def accumulating(self, last: bool):
        return contextlib.nullcontext()  # ZeRO reduces in step() (unmanaged accumulation)

    def local(self, batch: dict) -> dict:
        return batch  # no context parallelism under DeepSpeed (cp.check)

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)  # the loss is already normalised over the step

    def step(self) -> float:
        self.model.step()
        self.scheduler.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def generation(self):
        """Around a generate() call. ZeRO-3 `gather`: every parameter gathered for the call's length (ranks sample
        different lengths); `layerwise`: nothing gathered here, ZeRO-3's hooks gather layer by layer in each forward
        and callers pass synced_gpus=True (`synced_generation`)."""
        if self.generation_mode != "gather":
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.inner.parameters()), modifier_rank=None)

    def save(self, path: Path, runtime) -> None:
        """Every rank writes its partition of the trained parameters and optimizer states into checkpoint folder
        `path` (frozen weights are not saved)."""
        self.model.save_checkpoint(
            str(path / _FOLDER), tag=_TAG, client_state={}, save_latest=False, exclude_frozen_parameters=True
        )

    def load(self, path: Path, runtime) -> None:
        """Every rank reads its partitions back (ft restores the schedule itself)."""
        loaded, _ = self.model.load_checkpoint(
            str(path / _FOLDER),
            tag=_TAG,
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
        )
        if loaded is None:
            raise FtError(
                f"checkpoint {path}: DeepSpeed found no state to load in {path / _FOLDER}; resume with the "
                "same config and world size, or start a new output.dir"
            )

    def full_state_dict(self, trainable_only: bool, dtype=None) -> dict | None:
        """ZeRO-3: the saved tensors gathered one at a time (a collective), copied to CPU on rank 0 (floating ones cast
        to `dtype` first, on the device: artifacts/weights.py saved_tensor); with trainable_only only the trained
        parameters are gathered, never the frozen base. ZeRO-1/2: None (whole on every rank)."""
        if self.stage < 3:
            return None
        import deepspeed

        from finetune.artifacts.weights import saved_tensor

        rank0 = torch.distributed.get_rank() == 0
        out = {}
        for name, tensor in self.inner.state_dict(keep_vars=True).items():
            if trainable_only and not (isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad):
                continue  # decided before any gather: frozen partitions stay where they are
            with (
                deepspeed.zero.GatheredParameters([tensor], modifier_rank=None)
                if hasattr(tensor, "ds_id")
                else contextlib.nullcontext()
            ):
                if rank0:
                    out[name] = saved_tensor(tensor, dtype, copy=True)
        return out if rank0 else {}

    def full_parameters(self):
        """ZeRO-3: each parameter gathered on every rank for as long as the caller holds it, then partitioned again."""
        import deepspeed

        for name, p in self.inner.named_parameters(remove_duplicate=False):
            if not hasattr(p, "ds_id"):
                yield name, p.detach()
                continue
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                yield name, p.detach()


def read_trained(checkpoint: Path, model=None) -> dict:
    """The trained parameters of a ZeRO checkpoint folder as one fp32 state dict (one process, no GPU needed; `model`
    is not needed: DeepSpeed's files name every parameter)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint / _FOLDER), tag=_TAG, exclude_frozen_parameters=True)
