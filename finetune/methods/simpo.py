"""Simple preference optimisation (SimPO), and what it shares with ORPO: reference-free preference methods.

They train on DPO's micro-batches (chosen stacked over rejected, one forward pass) and score each answer by its
length-normalised log-probability: the mean over its trained (completion) tokens, ā = logπ(y)/|y|. SimPO's loss,
with z = β·ā_c − β·ā_r − γ and ε the label smoothing:
  −(1−ε)·log σ(z) − ε·log σ(−z)
Its implicit reward is β·ā. The step's loss is the mean over its pairs (the normaliser counts pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.methods import Context, pixels, register
from finetune.methods.dpo import DPO, reward_metrics
from finetune.methods.head import LossHead, loss_head
from finetune.methods.loss import metric


class ReferenceFree(DPO):
    """DPO's micro-batches and pair count, without a reference model: the policy's own mean log-probabilities."""

    def __init__(self, section, pad_id: int, micro_batch_size: int, head: LossHead | None = None, pixels=None):
        self.pad_id, self.micro, self.reference, self.held_out = pad_id, micro_batch_size, None, None
        self.validates = section.validates
        self.head = head or LossHead()  # how the logits are computed (plan.loss_implementation)
        self.images = pixels  # pairs whose prompt holds images (finetune.vision.Pixels), as DPO's

    @classmethod
    def create(cls, section, context: Context) -> ReferenceFree:
        plan = context.plan
        return cls(section, context.pad_id, plan.micro_batch_size, loss_head(plan, True), pixels(context))

    def mean_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each answer's log-probability averaged over its trained tokens: (chosen, rejected), one per pair."""
        logps, counts = self.sequence_logps(model, batch)
        return (logps / counts.clamp(min=1)).chunk(2)


def simpo_losses(beta: float, gamma: float, smoothing: float, chosen, rejected) -> torch.Tensor:
    """Per-pair SimPO losses from mean log-probabilities (see the module docstring)."""
    z = beta * (chosen - rejected) - gamma
    return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)


@register("simpo")
class SimPO(ReferenceFree):
    """Batches and loss for SimPO."""

    def __init__(self, section, pad_id: int, micro_batch_size: int, head: LossHead | None = None, pixels=None):
        super().__init__(section, pad_id, micro_batch_size, head, pixels)
        self.beta, self.gamma, self.smoothing = section.beta, section.gamma, section.label_smoothing

    def loss(self, model, batch: dict, normaliser: float):
        chosen, rejected = self.mean_logps(model, batch)
        losses = simpo_losses(self.beta, self.gamma, self.smoothing, chosen, rejected)
        metrics = {
            **reward_metrics(self.beta * chosen, self.beta * rejected),
            "logps/chosen": metric(chosen.mean()),
            "logps/rejected": metric(rejected.mean()),
        }
        return losses.sum() / normaliser, metrics
