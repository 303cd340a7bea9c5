"""Reward-model training: a sequence classifier scores prompt + answer, the chosen answer should score higher.

The model is loaded with a `score` head in place of the LM head (plan.head, models.auto_class): one value per
sequence, read at its last token that is not padding. Micro-batches are DPO's (chosen stacked over rejected, one
forward pass). Per pair, with r the scores, m the pair's margin (0 unless `margin: true`) and c = center_rewards:
  −log σ(r_c − r_r − m) + c·(r_c + r_r)²
the Bradley–Terry loss (with Llama 2's margin) and trl's centring term. The step's loss is the mean over its pairs
(the normaliser counts pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.errors import FtError
from finetune.methods import Context, register
from finetune.methods.dpo import DPO, reward_metrics

MARGIN = "margin"


def reward_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor, center: float) -> torch.Tensor:
    """Per-pair losses from the scores (see the module docstring)."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


@register("reward")
class Reward(DPO):
    """DPO's micro-batches and pair count; the scores come from the model's head, no reference model."""

    def __init__(self, section, pad_id: int, micro_batch_size: int):
        self.pad_id, self.micro, self.reference, self.held_out = pad_id, micro_batch_size, None, None
        self.validates = section.validates
        self.use_margin, self.center = section.margin, section.center_rewards

    @classmethod
    def create(cls, section, context: Context) -> Reward:
        if section.margin:
            check_margins(context.dataset)
        return cls(section, context.pad_id, context.plan.micro_batch_size)

    def micro_batches(self, dataset, indices: list[int]) -> list[dict]:
        out = super().micro_batches(dataset, indices)
        if not self.use_margin:
            return out
        margins = dataset.select(indices)[MARGIN]
        for i, batch in enumerate(out):
            part = margins[i * self.micro : (i + 1) * self.micro]
            # training rows all have one (check_margins); held-out rows without one count as margin 0
            batch[MARGIN] = torch.tensor([m if m is not None else 0.0 for m in part], dtype=torch.float32)
        return out

    def scores(self, model, batch: dict) -> torch.Tensor:
        """One score per sequence (fp32), from the classifier's single output."""
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits[:, 0].float()

    def loss(self, model, batch: dict, normaliser: float):
        chosen, rejected = self.scores(model, batch).chunk(2)
        margin = batch[MARGIN].to(chosen.device) if MARGIN in batch else torch.zeros_like(chosen)
        losses = reward_losses(chosen, rejected, margin, self.center)
        metrics = reward_metrics(chosen, rejected)
        return losses.sum() / normaliser, metrics


def check_margins(dataset) -> None:
    """With `margin: true` every pair needs a margin: the rows without one, by file:line, before any training."""
    if dataset is None:
        return
    columns = dataset.column_names
    if MARGIN not in columns:
        raise FtError(
            "method.margin: the prepared data has no margin column (prepared by an older ft); run ft preprocess "
            "again, or set method.margin: false"
        )
    origins = dataset["_origin"] if "_origin" in columns else [f"row {i}" for i in range(len(dataset))]
    missing = [o for o, m in zip(origins, dataset[MARGIN]) if m is None]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise FtError(
            f"method.margin: {len(missing)} of {len(origins)} preference rows have no margin ({shown}); give every "
            f"row a number `margin` (or map a column to it with columns: {{margin: COLUMN}}), or set "
            f"method.margin: false"
        )
