"""Validation loss during training (and for `ft eval`'s loss); the task metric during training is
finetune.infer.evaluation.task_score."""

from __future__ import annotations

import torch

from finetune.data.collate import to_device
from finetune.methods.loss import host_values


@torch.no_grad()
def validation_metrics(model, method, dataset, device, autocast, batch_rows: int = 32) -> dict[str, float]:
    """eval_loss, plus the method's own metrics (e.g. DPO's reward accuracy) as eval_NAME, each weighted like the
    loss. The losses and metrics stay on the device until the last batch, then are read at once."""
    was_training = model.training
    model.eval()
    seen = []  # per micro-batch: its token count, loss and metrics
    for start in range(0, len(dataset), batch_rows):
        for batch in method.micro_batches(dataset, list(range(start, min(start + batch_rows, len(dataset))))):
            n = method.tokens(batch)  # counted on the host, before the batch moves
            batch = to_device(batch, device)  # tensors and per-layer-type masks
            with autocast():
                loss, metrics = method.loss(model, batch, 1.0)
            seen.append((n, loss, metrics))
    model.train(was_training)
    values = iter(host_values(*(v for _, loss, metrics in seen for v in (loss, *metrics.values()))))
    total, tokens, sums = 0.0, 0, {}
    for n, _, metrics in seen:
        total, tokens = total + next(values), tokens + n
        for k in metrics:
            sums[k] = sums.get(k, 0.0) + next(values) * n
    return {"eval_loss": total / max(tokens, 1), **{f"eval_{k}": v / max(tokens, 1) for k, v in sums.items()}}


def answer_loss(model, rows: list[dict], pad_id: int, batch_rows: int, pixels=None) -> float:
    """Mean loss over the labelled tokens of `rows` (input_ids and labels; images with a vision-language model's
    `pixels`, finetune.vision.Pixels), counted as SFT training counts them, on the model's device (ft eval's loss on
    reference answers)."""
    import contextlib

    import datasets

    from finetune.methods.sft import SFT

    method = SFT(pad_id, "sdpa", batch_rows, pixels=pixels)
    dataset = datasets.Dataset.from_list(rows)
    return validation_metrics(model, method, dataset, model.device, contextlib.nullcontext, batch_rows)["eval_loss"]
