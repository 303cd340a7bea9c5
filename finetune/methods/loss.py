"""The one place where the loss of a step is normalised.

A step's loss is the mean over every trained token of the global batch: the sum of token losses of
each micro-batch divided by the number of trained tokens in the whole step (over all micro-batches
and ranks), never a mean per micro-batch or per padded position. Data-parallel backends average
gradients over ranks, so each rank divides by tokens / world_size.
"""

from __future__ import annotations

import torch

IGNORE = -100
MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
)


def trained_tokens(labels: torch.Tensor, shifted: bool = False) -> int:
    """Positions that are a prediction target once labels are shifted by one (`shifted`: labels already shifted, the
    `shift_labels` of a context-parallel rank's share of a sequence, distributed/cp.py)."""
    return int(((labels if shifted else labels[..., 1:]) != IGNORE).sum())


def step_normaliser(local_tokens: int, world_size: int = 1, all_reduce=None) -> float:
    """Divisor for this rank's summed token losses so that averaged gradients give the global token mean."""
    total = all_reduce(local_tokens) if all_reduce is not None else local_tokens
    return max(total, 1) / world_size


def causal_lm_loss(model, batch: dict, normaliser: float, head) -> torch.Tensor:
    """Sum of next-token cross-entropy over trained tokens (computed by `head`, methods/head.py), divided by the
    step's normaliser."""
    return head.summed_nll(model, batch) / normaliser
