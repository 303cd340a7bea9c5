"""The one place where the loss of a step is normalised.

A step's loss is the mean over every trained token of the global batch: the sum of token losses of
each micro-batch divided by the number of trained tokens in the whole step (over all micro-batches
and ranks), never a mean per micro-batch or per padded position. Data-parallel backends average
gradients over ranks, so each rank divides by tokens / world_size.
"""

from __future__ import annotations

import torch

from finetune.data.masking import IGNORE
from finetune.vision import CROSS_ATTENTION_INPUTS, PIXEL_INPUTS, TOKEN_TYPE_INPUTS

MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",  # packed rows' sample index for state-space/linear-attention kernels (data/collate.py)
    *PIXEL_INPUTS,  # a vision-language model's images (finetune/vision.py)
    *TOKEN_TYPE_INPUTS,  # and its tokens' modalities
    *CROSS_ATTENTION_INPUTS,  # or the image tiles each token attends to
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


def router_loss(aux: torch.Tensor, share: float, coef: float) -> torch.Tensor:
    """A micro-batch's part of the step's MoE load-balancing loss (methods/router.py): coef × its loss × its share
    of the step's normaliser (its count of what the method normalises by, trained tokens, pairs or rows, divided by
    the normaliser). Summed over the step's micro-batches and averaged over ranks as gradients are, the step adds
    coef × the mean of its micro-batches' losses weighted by those counts (with equal micro-batches, trl's mean over
    accumulation steps), whichever ranks its micro-batches run on."""
    return coef * share * aux


def metric(value: torch.Tensor) -> torch.Tensor:
    """A figure a method logs for a micro-batch, as a 0-dim float64 tensor where it was computed (the device), never
    read there: the loop reads every metric of the step with its loss, in the step's one host sync (`host_values`).
    float64 holds the value `.item()` would have given exactly (float32, bf16 and integers up to 2**53 alike)."""
    return value.detach().double()


def host_values(*values) -> list[float]:
    """Python floats of `values` (numbers or 0-dim tensors), with one wait for the device for all the tensors on it:
    the training step's only host sync (its loss, gradient norm and the method's metrics), and validation's."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().to(tensors[0].device, torch.float64) for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]
