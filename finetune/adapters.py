"""What is trained: the whole model, or a LoRA / QLoRA / DoRA adapter through peft."""

from __future__ import annotations

from finetune.config.schema import AdapterSection
from finetune.errors import FtError


def apply_adapter(model, adapter: AdapterSection, plan):
    """Make the planned parameters trainable; returns the (possibly peft-wrapped) model."""
    if plan.adapter == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if plan.quantization in ("nf4", "int8"):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=plan.gradient_checkpointing,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    modules = list(adapter.modules_to_save)
    if any(d.field == "embeddings" for d in plan.decisions):
        modules = list(dict.fromkeys([*modules, "embed_tokens", "lm_head"]))
    config = LoraConfig(r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout, target_modules=adapter.target_modules,
                        use_dora=adapter.dora, use_rslora=adapter.rslora, modules_to_save=modules or None, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        if "not found" in str(e) or "Target modules" in str(e):
            raise FtError(f"adapter.target_modules: {adapter.target_modules} matches no module of this model; its linear layers are: {', '.join(linear_names(model))}") from None
        raise


def linear_names(model) -> list[str]:
    import torch

    return sorted({name.split(".")[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
