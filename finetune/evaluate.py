"""Evaluation during training: validation loss, and a task metric by greedy generation (shared with `ft eval`)."""

from __future__ import annotations

import torch


def validation_loss(model, method, dataset, device, autocast, batch_rows: int = 32) -> float:
    """Mean next-token loss over every trained token of the validation set (for DPO: mean loss per pair)."""
    return validation_metrics(model, method, dataset, device, autocast, batch_rows)["eval_loss"]


@torch.no_grad()
def validation_metrics(model, method, dataset, device, autocast, batch_rows: int = 32) -> dict[str, float]:
    """eval_loss, plus the method's own metrics (e.g. DPO's reward accuracy) as eval_NAME, each weighted like the
    loss."""
    was_training = model.training
    model.eval()
    total, tokens, sums = 0.0, 0, {}
    for start in range(0, len(dataset), batch_rows):
        for batch in method.micro_batches(dataset, list(range(start, min(start + batch_rows, len(dataset))))):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            n = method.tokens(batch)
            with autocast():
                loss, metrics = method.loss(model, batch, 1.0)
            total, tokens = total + float(loss), tokens + n
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v * n
    model.train(was_training)
    return {"eval_loss": total / max(tokens, 1), **{f"eval_{k}": v / max(tokens, 1) for k, v in sums.items()}}


@torch.no_grad()
def task_score(
    model, tokenizer, jinja: str | None, section, device, batch_size: int = 32, context=None, synced: bool = False
) -> float:
    """Mean score of the `evaluation:` section's metric over its prompt/answer file, answers generated greedily.

    Prompts are rendered with `jinja` (the job's chat template) and generated in length-sorted batches by
    the same engine and scored by the same metrics as `ft eval`. During training, `context` gives the job's
    autocast and parameter gathering (fp32 master weights must not reach half-precision-only kernels such as
    flash-attention), and `synced` keeps the ranks of a sharded model in step.
    """
    from finetune.infer.batches import plan
    from finetune.infer.engines import Sampling, TransformersEngine
    from finetune.infer.prompts import PromptSpec, columns, encode, read_prompts
    from finetune.infer.scoring import Scorer, from_section

    scorer = Scorer(from_section(section))
    prompts = read_prompts(PromptSpec(section.path, samples=section.samples)).prompts
    ids = [encode(p, tokenizer, jinja) for p in prompts]
    engine = TransformersEngine(
        model, tokenizer, Sampling(max_new_tokens=section.max_new_tokens), device, context=context, synced=synced
    )
    was_training = model.training
    model.eval()
    texts = [""] * len(prompts)
    try:
        for number, batch in enumerate(plan([len(i) for i in ids], batch_size)):
            for i, (text, _) in zip(batch, engine.generate([ids[i] for i in batch], number)):
                texts[i] = text
    finally:
        model.train(was_training)
    scores = scorer(texts, [p.reference for p in prompts], columns(prompts), [p.origin for p in prompts])
    return sum(scores) / max(len(scores), 1)
