"""Validation loss during training (and for `ft eval`'s loss); the task metric during training is
finetune.infer.evaluation.task_score."""

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
