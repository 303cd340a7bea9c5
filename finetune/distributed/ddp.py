"""torch DistributedDataParallel: a full replica per rank, gradients all-reduced after the last micro-batch.

The gradients are views into DDP's all-reduce buckets (`gradient_as_bucket_view`): without it the buckets hold a
second copy of every gradient (per-rank peak of full fine-tuning with AdamW: 5.1x the fp32 model instead of 3.8x above a
tiny-model run, measured on 2 gloo ranks, tests/test_gpu_first_contact.py). After its first synchronised backward DDP
rebuilds its buckets once, in the order the gradients arrived (at the next forward). Until then the gradients are
freed after each step and every micro-batch is synchronised, so that each backward copies each fresh gradient into its
bucket as soon as it is complete; afterwards they stay views, zeroed in place, and no_sync accumulates into them
(`zero_in_place`). Views kept across the rebuild would keep the old buckets beside the new ones (measured: 4.7x), and
gradients freed later would be allocated afresh beside the buckets while no_sync accumulates (4.7x).
"""

from __future__ import annotations

import contextlib

import torch


def wrap(model, device: torch.device, unused: bool = False):
    """The model wrapped in DDP (only trainable parameters are synchronised), its gradients views of the buckets.
    `unused`: some trainable parameters may take no part in a forward (a vision-language model's projector or
    cross-attention layers when a micro-batch has no image: plan.image_free_rows), which DDP then finds after each
    forward (a walk of the autograd graph); a frozen tower is not synchronised at all and needs no search."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # every trainable parameter is in a bucket (torch nn/parallel/distributed.py _build_params_for_reducer), so the
    # buckets are the gradients; NCCL all-reduces each bucket in place, on the GPU where the parameters live
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused, gradient_as_bucket_view=True)


def zero_in_place(model) -> bool:
    """The gradients are views of DDP's final buckets (rebuilt: torch nn/parallel/distributed.py _pre_forward sets
    _has_rebuilt_buckets): zero them in place (optimizer.zero_grad(set_to_none=False)) and accumulate under no_sync.
    Rebuilding drops the old buckets before allocating the new ones (torch's Reducer::initialize_buckets clears them
    first), which frees them only where no gradient still views them; on GPUs the caching allocator holds a bucket
    from its allocation (CPU RSS counts pages only as they are written), so fresh gradients accumulated beside
    allocated buckets would count in full there."""
    from finetune.compat import ddp_buckets_rebuilt

    return getattr(model, "gradient_as_bucket_view", False) and ddp_buckets_rebuilt(model)


def accumulating(model, last: bool):
    """Skip the gradient all-reduce on every micro-batch but the last of a step, once the gradients are views of the
    final buckets (`zero_in_place`; before, each micro-batch is all-reduced: the buckets then hold the sum of the
    ranks' means so far, which the next backward adds to, as it would to a local sum)."""
    if last or not hasattr(model, "no_sync") or not zero_in_place(model):
        return contextlib.nullcontext()
    return model.no_sync()


def unwrap(model):
    return model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
