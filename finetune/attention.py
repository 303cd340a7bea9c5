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

A sliding-window layer (the `sliding_window` its attention module passes, as it does to flash-attention) attends
to the `sliding_window` tokens up to each query, as transformers' masks have it: the kernel's window_size is
(sliding_window - 1, 0); per sample, a banded causal mask. Attention sinks (`s_aux`) are not SDPA's: the planner
never runs a model with sinks on sdpa_varlen (plan/attention.py), and a call with them is refused.

A call that is not over the packed row runs as attn_implementation sdpa would: a bidirectional module (a vision
tower, to which a vision-language model passes the row's keyword arguments) or one over another length than the row.

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
_last_bounds: list = [None, []]  # [cu_seq_lens tensor, its boundaries as a list]: likewise


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


def _kernel_path(query, key, value, cu, max_len, scaling, window=None):
    """(1, H, T, D) tensors -> (1, T, Hq, D), one varlen kernel call over the packed row."""
    cu = cu.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    left = -1 if window is None else window - 1
    out = _KERNEL(
        q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(left, 0), enable_gqa=q.shape[1] != k.shape[1]
    )
    return out.unsqueeze(0)


def _causal(q, k, v, dropout_p, scaling, window=None):
    gqa = q.shape[1] != k.shape[1]
    n = q.shape[2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout_p, enable_gqa=gqa
        )
    index = torch.arange(n, device=q.device)
    band = (index[None, :] <= index[:, None]) & (index[:, None] - index[None, :] < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=scaling, dropout_p=dropout_p, enable_gqa=gqa)


def _bounds(cu) -> list[int]:
    """The sample boundaries on the host: `host_bounds`, which ft's collator attaches to cu and its to_device keeps;
    cu given without them is read once per batch."""
    bounds = getattr(cu, "host_bounds", None)
    if bounds is None:
        if _last_bounds[0] is not cu:
            _last_bounds[:] = [cu, cu.tolist()]
        bounds = _last_bounds[1]
    return bounds


def _over_the_row(query, cu) -> bool:
    """Whether the call attends over the packed row that cu marks (its length, cu's last boundary); a device cu without
    the host's boundaries is taken at its word (reading it would wait for the device)."""
    if getattr(cu, "host_bounds", None) is None and cu.device.type != "cpu":
        return True
    return query.shape[2] == _bounds(cu)[-1]


def _per_sample(query, key, value, cu, dropout_p, scaling, window=None):
    """(1, H, T, D) tensors -> (1, T, Hq, D), one causal SDPA call per sample."""
    bounds = _bounds(cu)
    # split, not sliced: the backward pass then concatenates the samples' gradients once, where each slice's backward
    # would fill a zero tensor of the whole row (per sample: 1.65x the attention's CPU time at 11 samples a row)
    sizes = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    parts = [
        _causal(q, k, v, dropout_p, scaling, window)
        for q, k, v in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))
        if q.shape[2]
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype where autocast is on: under it with fp32 weights RoPE leaves q and k in fp32
    while v is bf16, which the kernel refuses (and the fallback's SDPA would cast anyway)."""
    # transformers 5.24 casts q/k/v the same way before flash-attention (integrations/flash_attention.py:16-17,
    # modeling_flash_attention_utils.py:595-597); torch's autocast casts every SDPA input to this dtype (ATen/
    # autocast_mode.h:853, policy lower_precision_fp), so neither path's numerics change, and varlen_attn gets one dtype
    device = tensors[0].device.type
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def sdpa_varlen_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) -> attention output (B, T, Hq, D); B is 1 when packed."""
    dropout_p = dropout if module.training else 0.0
    cu = kwargs.get("cu_seq_lens_q")
    # Exactly what attn_implementation sdpa does where the call is not over the packed row: not packed (generation with
    # a KV cache, padded batches), or a bidirectional module (a vision tower's, which a vision-language model passes
    # the row's keyword arguments on to) or one over another sequence than the row (its image patches)
    if cu is None or not getattr(module, "is_causal", True) or not _over_the_row(query, cu):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if kwargs.get("s_aux") is not None:
        raise ValueError("sdpa_varlen cannot run attention sinks (s_aux); use eager or flex_attention")
    window = kwargs.get("sliding_window")
    query, key, value = _autocast_dtype(query, key, value)
    if uses_kernel(query, dropout_p):
        return _kernel_path(query, key, value, cu, _longest(cu, kwargs.get("max_length_q")), scaling, window), None
    return _per_sample(query, key, value, cu, dropout_p, scaling, window), None


def register() -> str:
    """Make `sdpa_varlen` a valid attn_implementation (idempotent); returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, sdpa_varlen_attention)
    # unpacked calls (generation, padded batches) need sdpa's padding mask
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
