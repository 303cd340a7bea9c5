"""What is trained: the whole model, or a LoRA / QLoRA / DoRA adapter through peft.

The adapter's starting values do not depend on how the model was built: `initial_value` gives each adapter tensor
from the job's seed and the tensor's name alone (lora_A kaiming-uniform as peft draws it, lora_B zeros), so one
process and N ranks that each build only their shard start from the same adapter.
"""

from __future__ import annotations

import hashlib
import math
import re

from finetune.config.schema import AdapterSection
from finetune.errors import FtError

# random at the start (peft's default init); the other adapter tensors start at zero
_DRAWN = ("lora_A", "lora_embedding_B")
_ZERO = ("lora_B", "lora_embedding_A")


def apply_adapter(model, adapter: AdapterSection, plan):
    """Make the planned parameters trainable; returns the (possibly peft-wrapped) model. Works on a meta-device model
    too."""
    vision = getattr(plan, "vision", False)
    if plan.adapter == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        if vision:  # the vision side as planned (model.train_vision)
            from finetune.vision import freeze

            freeze(model, plan.train_vision)
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if plan.quantization in ("nf4", "int8") and plan.precision == "fp16":
        # fp16: peft casts the weights it does not quantize (norms, embeddings, head) to fp32 for stable training
        # (memory.py counts them so). In bf16 they stay bf16, as the peers keep them. Checkpointing was already set
        # up layer by layer (models.finish_model); peft would turn it back on for every layer.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    modules = list(adapter.modules_to_save)
    score = plan.head == "score"  # a reward model: its new score layer is trained in full next to the adapter
    if plan.train_embeddings:  # tokens were added: their rows are trained in full
        modules = list(dict.fromkeys([*modules, "embed_tokens", "score" if score else "lm_head"]))
    if score:
        modules = list(dict.fromkeys([*modules, "score"]))
    exclude = None
    if vision:  # the adapter is on the language model; the projector (and the tower) train in full where planned
        from finetune.vision import parts_of, vision_names

        towers, projectors = parts_of(model)
        trained = {"projector": projectors, "all": towers + projectors}.get(plan.train_vision, [])
        modules = list(dict.fromkeys([*modules, *trained]))
        exclude = "|".join(f"{re.escape(name)}(\\..*)?" for name in vision_names(model)) or None
    targets, dropout = lora_targets(model, adapter, tuple(modules))
    config = LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=dropout,
        target_modules=adapter.target_modules if targets is None else list(targets.modules),
        target_parameters=None if targets is None else list(targets.parameters) or None,
        use_dora=adapter.dora,
        use_rslora=adapter.rslora,
        modules_to_save=modules or None,
        exclude_modules=exclude,
        task_type="SEQ_CLS" if score else "CAUSAL_LM",
    )
    try:
        # peft upcasts bf16/fp16 adapters to fp32 (autocast_adapter_dtype): not under pure bf16
        model = get_peft_model(model, config, autocast_adapter_dtype=not plan.pure_bf16)
    except ValueError as e:
        if "not found" in str(e) or "Target modules" in str(e) or "no parameter was matched" in str(e):
            raise FtError(
                f"adapter.target_modules: {adapter.target_modules} matches no module of this model; its linear "
                f"layers are: {', '.join(linear_names(model))}"
            ) from None
        raise
    if plan.pure_bf16:
        trained_in_bf16(model)
    if getattr(plan, "sparse_dropout", False):  # on a CPU: only the dropped positions drawn (finetune/dropout.py)
        from finetune.dropout import use_sparse_dropout

        use_sparse_dropout(model)
    return model


def lora_targets(model, adapter: AdapterSection, trained_in_full: tuple[str, ...]):
    """(targets, lora_dropout). Dense models: None (peft resolves adapter.target_modules itself) and
    adapter.dropout. MoE models: ft's own targets (finetune/experts.py: attention, dense MLPs, shared and routed
    experts, never routers or gates), and no dropout where peft adapts weights through lora.ParamWrapper, which adds
    the low-rank update to the weight itself and so has no adapter input to drop out. `ft plan` refuses an explicit
    dropout or DoRA there (finetune/config/moe_checks.py); this is the rank side's check."""
    from finetune import experts

    if not experts.is_moe(model):
        return None, adapter.dropout
    targets = experts.adapter_targets(model, adapter.target_modules, trained_in_full)
    if not targets.modules and not targets.parameters:
        raise FtError(
            f"adapter.target_modules: {adapter.target_modules} matches no linear layer or expert weight of this "
            f"model; its linear layers are: {', '.join(linear_names(model))}"
        )
    if not targets.parameters:
        return targets, adapter.dropout
    from finetune.config.moe_checks import dora_problem, dropout_problem

    for problem in (dropout_problem(adapter), dora_problem(adapter)):
        if problem is not None:
            raise FtError(problem.render())
    return targets, 0.0


def trained_in_bf16(model) -> None:
    """Hold every trained parameter in bf16 (plan.pure_bf16). peft creates an adapter in fp32 where it cannot take the
    base layer's dtype: on the meta device (FSDP2 builds there) and over a 4/8-bit base (an integer dtype)."""
    import torch

    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.bfloat16:
            p.data = p.data.to(torch.bfloat16)  # as nn.Module.to converts a parameter in place (same Parameter)


def linear_names(model) -> list[str]:
    import torch

    return sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def is_dora_magnitude(name: str) -> bool:
    return "lora_magnitude_vector" in name.split(".")


def initial_value(name: str, shape: tuple, seed: int):
    """The starting value of adapter tensor `name` (fp32, on the CPU): drawn from a generator seeded by the job's seed
    and the name, so it is the same however and wherever the model is built. Distributions as peft's default init."""
    import torch

    value = torch.zeros(shape, dtype=torch.float32)
    parts = name.split(".")
    if not any(k in parts for k in _DRAWN):
        if not any(k in parts for k in _ZERO):
            raise FtError(
                f"adapter: no starting value known for {name}; sharded loading initialises lora_A/lora_B (and "
                "DoRA) adapters only"
            )
        return value
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if "lora_A" in parts:
        return torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=gen)
    return torch.nn.init.normal_(value, generator=gen)


def init_adapter(model, seed: int) -> None:
    """Set every adapter tensor of a whole (unsharded) model to its `initial_value`, replacing peft's random draw."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            # an adapter tensor whose starting value `initial_value` gives (not DoRA's magnitude, from the base weights)
            if p.requires_grad and any(k in name.split(".") for k in _DRAWN + _ZERO):
                p.copy_(initial_value(name, tuple(p.shape), seed).to(p.dtype))
