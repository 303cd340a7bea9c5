"""`sdpa_varlen`: padding-free attention on torch's SDPA, registered through transformers' AttentionInterface.

A batch is one row of concatenated samples; `cu_seq_lens_q` (cumulative sample lengths, as the
flash-attention varlen kernels take them) marks the boundaries, and each sample gets its own causal
SDPA call. Attention never crosses samples, no mask is materialised, and no compute goes to padding or
to the masked T x T blocks that a 4-D mask still pays for. This is what packing uses where
flash-attention is not available (CPUs, GPUs older than Ampere). Registration uses transformers'
public extension point; nothing of transformers is patched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "sdpa_varlen"


def sdpa_varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs):
    """query (1, Hq, T, D), key/value (1, Hkv, T, D) -> attention output (1, T, Hq, D)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # no boundaries given: one causal sequence per row (right padding is never attended)
        cu = torch.tensor([0, query.shape[2]])
        if query.shape[0] != 1:
            return _causal(module, query, key, value, dropout, scaling).transpose(1, 2).contiguous(), None
    bounds = cu.tolist()
    parts = [_causal(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout, scaling) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _causal(module, q, k, v, dropout, scaling):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0,
                                          enable_gqa=q.shape[1] != k.shape[1])


def register() -> str:
    """Make `sdpa_varlen` a valid attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, sdpa_varlen_attention)
    return NAME
