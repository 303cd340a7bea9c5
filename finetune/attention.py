"""`sdpa_varlen`: padding-free attention for packed rows, registered through transformers' AttentionInterface.

A packed batch is one row of concatenated samples; `cu_seq_lens_q` (cumulative sample lengths, int32,
as flash-attention's varlen kernels take them) marks the boundaries and attention never crosses them.
Two ways to run it, same result:

- Kernel path (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256, no attention dropout): one call per
  layer to torch's `torch.nn.attention.varlen.varlen_attn` over the whole row. The longest sample
  (`max_length_q`) comes from the batch as a Python int; if it is a tensor it is read once per batch
  (cached on the `cu_seq_lens_q` object), so the layers never wait on the host.
- Fallback (CPU, fp32, older torch, dropout in training): one causal SDPA call per sample. CPU gets this
  because torch's varlen op has no CPU kernel (2.13: `aten::_flash_attention_forward` is CUDA-only).

No mask is materialised and no compute goes to padding or to cross-sample blocks. Registration uses
transformers' public extension point; nothing of transformers is patched.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn as _KERNEL
except ImportError:  # older torch: per-sample SDPA only
    _KERNEL = None

NAME = "sdpa_varlen"
_HALF = (torch.float16, torch.bfloat16)
_last_cu: list = [None, 0]  # [cu_seq_lens tensor, its longest sample]: one host read per batch, not per layer


@functools.cache
def _flash_device(index: int) -> bool:
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index)[0] >= 8


def uses_kernel(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether torch's varlen kernel takes this call (else per-sample SDPA)."""
    # torch 2.13 nn/attention/varlen.py: varlen_attn runs aten::_flash_attention_forward (CUDA, sm80+,
    # fp16/bf16) with dropout hard-wired to 0, is causal for window_size=(-1, 0), and accepts Hkv < Hq
    # with enable_gqa=True, so on such GPUs one call does what the per-sample loop does.
    return (
        _KERNEL is not None
        and query.is_cuda
        and query.dtype in _HALF
        and query.shape[0] == 1
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
        and dropout_p == 0.0
        and _flash_device(query.get_device())
    )


def _longest(cu: torch.Tensor, given) -> int:
    if isinstance(given, int):
        return given
    if _last_cu[0] is not cu:
        _last_cu[:] = [cu, int((cu[1:] - cu[:-1]).max())]
    return _last_cu[1]


def _kernel_path(query, key, value, cu, max_len, scaling):
    """(1, H, T, D) tensors -> (1, T, Hq, D), one varlen kernel call over the packed row."""
    cu = cu.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = _KERNEL(
        q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.unsqueeze(0)


def _causal(q, k, v, dropout_p, scaling):
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, dropout_p=dropout_p, enable_gqa=q.shape[1] != k.shape[1]
    )


def _per_sample(query, key, value, cu, dropout_p, scaling):
    """(1, H, T, D) tensors -> (1, T, Hq, D), one causal SDPA call per sample (reads cu on the host)."""
    bounds = cu.tolist()
    parts = [
        _causal(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], dropout_p, scaling)
        for s, e in zip(bounds[:-1], bounds[1:])
        if e > s
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def sdpa_varlen_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> attention output (B, T, Hq, D); B is 1 when packed."""
    dropout_p = dropout if module.training else 0.0
    cu = kwargs.get("cu_seq_lens_q")
    if (
        cu is None
    ):  # not packed (generation with a KV cache, padded batches): exactly what attn_implementation sdpa does
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if uses_kernel(query, dropout_p):
        return _kernel_path(query, key, value, cu, _longest(cu, kwargs.get("max_length_q")), scaling), None
    return _per_sample(query, key, value, cu, dropout_p, scaling), None


def register() -> str:
    """Make `sdpa_varlen` a valid attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, sdpa_varlen_attention)
    # unpacked calls (generation, padded batches) need sdpa's padding mask
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
