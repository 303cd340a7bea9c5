"""Training methods: each supplies the micro-batches of a step and the loss of a micro-batch.

`build` makes the configured method once the backend has wrapped the model (GRPO samples from it; a
DPO/GRPO reference is the same model with its adapter disabled, a frozen copy, or precomputed log-probs).
"""

from __future__ import annotations

from finetune.errors import FtError


def rows_per_step(method, global_batch: int) -> int:
    """Dataset rows one optimizer step consumes: sequences (SFT), pairs (DPO), prompts (GRPO: completions / group
    size)."""
    return global_batch // method.num_generations if method.name == "grpo" else global_batch


def build(config, plan, prepared, attn: str, engine, device, runtime, autocast):
    from finetune.methods.sft import SFT

    m, tokenizer = config.method, prepared.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if m.name == "sft":
        return SFT(pad, attn, plan.micro_batch_size)
    reference = _reference(config, plan, engine, prepared, attn, device)
    if m.name == "dpo":
        from finetune.methods.dpo import DPO, precompute

        method = DPO(m, pad, plan.micro_batch_size, reference)
        if m.reference == "precomputed":
            method.reference = precompute(engine.model, method, prepared.train, runtime, device, autocast)
        return method
    from finetune.methods.grpo import GRPO, Generator
    from finetune.methods.rewards import load_rewards

    if m.engine == "vllm":
        raise FtError(
            "method.engine: vllm generation for GRPO is not available in this version of ft; set engine: "
            "transformers (or auto)"
        )
    return GRPO(
        m,
        tokenizer,
        plan.micro_batch_size,
        Generator(engine, tokenizer, m, device, autocast),
        reference,
        load_rewards(m.rewards),
    )


def _reference(config, plan, engine, prepared, attn, device):
    """The reference model DPO (always) and GRPO (with kl_coef > 0) compare the policy with, as the plan chose it."""
    from finetune.methods import dpo

    if plan.reference in ("none", "precomputed"):
        return None
    if plan.reference == "adapter":
        return dpo.AdapterDisabled(engine.inner)
    from finetune.distributed.engine import create_reference

    return dpo.FrozenCopy(
        create_reference(
            config.model,
            config.adapter,
            plan,
            prepared.tokenizer,
            attn,
            device,
            config.train.seed,
            config.train,
            config.distributed,
        )
    )
