"""Odds ratio preference optimisation (ORPO): the SFT loss on the chosen answer plus an odds-ratio term, no reference.

With ā the mean log-probability of an answer over its trained tokens (simpo.py), p = exp(ā) and
odds(y) = p / (1 − p), each pair's loss is (λ: the `lambda` key)
  nll + λ·or,   nll = −ā_c,   or = −log σ(log odds(y_c) − log odds(y_r)),   log odds = ā − log(1 − exp(ā))
as the ORPO paper defines it (its L_SFT is the chosen answer's NLL averaged over the answer's tokens). trl's
ORPOTrainer differs in the NLL only: it averages over every token of the micro-batch's chosen sequences, prompts
included. The implicit reward is λ·ā. The step's loss is the mean over its pairs (the normaliser counts pairs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from finetune.methods import register
from finetune.methods.dpo import reward_metrics
from finetune.methods.head import LossHead
from finetune.methods.loss import metric
from finetune.methods.simpo import ReferenceFree

_LOG_HALF = -math.log(2)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, accurate on both sides of −log 2 (Mächler's two forms)."""
    x = x.clamp(max=-1e-7)  # an answer of probability 1 has infinite odds: keep the log finite
    return torch.where(x < _LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def log_odds_ratio(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """log odds(y_c) − log odds(y_r) from mean log-probabilities."""
    return (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))


@register("orpo")
class ORPO(ReferenceFree):
    """Batches and loss for ORPO."""

    def __init__(self, section, pad_id: int, micro_batch_size: int, head: LossHead | None = None, pixels=None):
        super().__init__(section, pad_id, micro_batch_size, head, pixels)
        self.weight = section.lambda_

    def loss(self, model, batch: dict, normaliser: float):
        chosen, rejected = self.mean_logps(model, batch)
        log_odds = log_odds_ratio(chosen, rejected)
        nll, odds_term = -chosen, -F.logsigmoid(log_odds)
        losses = nll + self.weight * odds_term
        metrics = {
            **reward_metrics(self.weight * chosen, self.weight * rejected),
            "logps/chosen": metric(chosen.mean()),
            "logps/rejected": metric(rejected.mean()),
            "nll": metric(nll.mean()),
            "log_odds": metric(log_odds.mean()),
        }
        return losses.sum() / normaliser, metrics
