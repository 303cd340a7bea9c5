"""Collate tokenized rows (packed or not) into padded tensors for a causal LM.

Rows are `{"input_ids", "labels"}` with optional `position_ids`; packed rows (see packing.py) also
carry `seq_lens`. Padding goes to the longest row in the batch (optionally rounded up): input_ids with
`pad_id`, labels with -100, position_ids counting 0, 1, ... along the padding as if it were one more
sequence.
"""

from __future__ import annotations

import torch

from finetune.data.masking import IGNORE
from finetune.errors import DataError

MASK_IMPLS = ("sdpa", "eager")  # packed rows get a 4-D additive mask
VARLEN_IMPLS = ("flash_attention_2", "sdpa_varlen")  # packed rows become one row with sample boundaries (varlen)


def _row_positions(row: dict) -> list[int]:
    if "position_ids" in row:
        return list(row["position_ids"])
    if "seq_lens" in row:
        return [p for n in row["seq_lens"] for p in range(n)]
    return list(range(len(row["input_ids"])))


def _check_row(i: int, row: dict) -> None:
    n = len(row["input_ids"])
    if len(row["labels"]) != n:
        raise DataError(f"batch row {i}: {n} input_ids but {len(row['labels'])} labels")
    if "position_ids" in row and len(row["position_ids"]) != n:
        raise DataError(f"batch row {i}: {n} input_ids but {len(row['position_ids'])} position_ids")
    if "seq_lens" in row and sum(row["seq_lens"]) != n:
        raise DataError(f"batch row {i}: seq_lens sum to {sum(row['seq_lens'])}, but the row has {n} tokens")


def _flatten(rows: list[dict]) -> dict:
    """Concatenate packed rows into one (padding-free varlen batch)."""
    return {
        "input_ids": [t for r in rows for t in r["input_ids"]],
        "labels": [t for r in rows for t in r["labels"]],
        "position_ids": [p for r in rows for p in _row_positions(r)],
        "seq_lens": [n for r in rows for n in r["seq_lens"]],
    }


def _pad_tensors(rows: list[dict], pad_id: int, length: int) -> dict[str, torch.Tensor]:
    """input_ids, labels, position_ids and a 2-D attention_mask (1 real, 0 pad), padded to `length`."""
    batch = len(rows)
    ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE, dtype=torch.long)
    positions = torch.zeros((batch, length), dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
        positions[i, :n] = torch.as_tensor(_row_positions(row), dtype=torch.long)
        positions[i, n:] = torch.arange(length - n)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}


def segment_ids(rows: list[dict], length: int) -> torch.Tensor:
    """(B, T) example number of each token within its row: 0, 0, 1, 1, 1, ...; -1 on padding."""
    seg = torch.full((len(rows), length), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        lens = torch.as_tensor(list(row["seq_lens"]), dtype=torch.long)
        ids = torch.repeat_interleave(torch.arange(len(lens)), lens)
        seg[i, : len(ids)] = ids
    return seg


def packed_attention_mask(
    segments: torch.Tensor, dtype: torch.dtype = torch.float32, window: int | None = None, chunk: int | None = None
) -> torch.Tensor:
    """(B, 1, T, T) mask where query i may see key j (same example, j <= i). torch.bool gives a boolean
    mask (True = attend; sdpa only, and the fastest there); a float dtype gives an additive mask (0 or
    the dtype's minimum; eager needs this). Padding is masked as key; each padding query sees only
    itself, so no softmax row is empty (an all-masked row gives NaN).

    `window`: a sliding-window layer's, as transformers masks it (masking_utils `sliding_window_overlay`: key j within
    the `window` tokens up to i). `chunk`: a chunked-attention layer's (`chunked_overlay`: i and j in the same chunk of
    the example, counted from the example's first token)."""
    length = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    real = (segments >= 0)[:, :, None]
    index = torch.arange(length)
    allowed = same & real & (index[None, :] <= index[:, None])
    if window is not None:
        allowed &= (index[:, None] - index[None, :] < window)[None]
    if chunk is not None:
        first = torch.zeros_like(segments)  # each token's example's first index
        first[:, 1:] = torch.where(segments[:, 1:] != segments[:, :-1], index[1:], 0)
        first = torch.cummax(first, dim=1).values
        block = (index[None, :] - first) // chunk
        allowed &= block[:, :, None] == block[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool)
    if dtype == torch.bool:
        return allowed[:, None, :, :]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, :, :]


def layer_masks(segments: torch.Tensor, kinds: dict, dtype: torch.dtype):
    """The packed rows' masks as the model takes them: one mask when every layer needs the same (`kinds` empty: full
    causal, or one kind), else one per layer type, the mapping transformers' mixed-attention models accept in place of
    the masks they would build (e.g. {"full_attention": ..., "sliding_attention": ...})."""
    if len(kinds) <= 1:
        spec = next(iter(kinds.values()), {})
        return packed_attention_mask(segments, dtype, spec.get("window"), spec.get("chunk"))
    return {
        kind: packed_attention_mask(segments, dtype, spec.get("window"), spec.get("chunk"))
        for kind, spec in kinds.items()
    }


def to_device(batch: dict, device) -> dict:
    """The batch's tensors (and a mapping of masks per layer type) on `device`. To a GPU the copies are queued behind
    the work already there, without waiting for it: a blocking copy would wait for the device's queue to drain (torch
    2.13 c10/cuda/CUDAFunctions.h:79-108, memcpy_and_sync: cudaStreamSynchronize), once per tensor per micro-batch."""
    queued = torch.device(device).type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if queued and t.device.type == "cpu":
            # from pinned memory a copy is asynchronous; the caching host allocator keeps the pinned block from reuse
            # until the copy's recorded event completes (ATen/core/CachingHostAllocator.h:175-182, free: :352-416)
            moved = t.pin_memory().to(device, non_blocking=True)
        else:
            moved = t.to(device)
        if hasattr(t, "host_bounds"):  # varlen boundaries: finetune/attention.py reads them without a device read
            moved.host_bounds = t.host_bounds
        return moved

    return {
        k: move(v) if torch.is_tensor(v) else {n: move(m) for n, m in v.items()} if isinstance(v, dict) else v
        for k, v in batch.items()
    }


def varlen_boundaries(seq_lens: list[int], length: int, sample_index: bool = False) -> dict:
    """Cumulative sample lengths for varlen attention kernels (trailing padding is its own segment); with
    `sample_index`, also `seq_idx` (1, T) int32, each token's sample number, which the state-space and
    linear-attention kernels take (mamba_ssm, causal_conv1d)."""
    lens = list(seq_lens) + ([length - sum(seq_lens)] if length > sum(seq_lens) else [])
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32)
    cu.host_bounds = bounds  # the same boundaries on the host, which travel with the tensor (to_device)
    longest = max(lens)
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if sample_index:
        out["seq_idx"] = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))[None]
    return out


def collate(
    rows: list[dict],
    pad_id: int,
    attn_implementation: str,
    pad_to_multiple_of: int | None = None,
    mask_dtype: torch.dtype = torch.float32,
    masks: dict | None = None,
    sample_index: bool = False,
) -> dict[str, torch.Tensor]:
    """Pad a batch of rows to its longest row; returns input_ids, labels, position_ids (all (B, T) long)
    and, depending on the rows and the attention implementation, attention_mask.

    - Unpacked rows (no `seq_lens`): attention_mask is 2-D (B, T), 1 on real tokens, 0 on padding.
    - Packed rows (`seq_lens`), "sdpa" or "eager": attention_mask is a 4-D mask (B, 1, T, T) that keeps
      attention inside each example: boolean for sdpa (unless another `mask_dtype` is asked for),
      additive float in `mask_dtype` for eager (transformers passes a
      4-D mask through unchanged; position_ids alone do not separate examples for these kernels).
      A bfloat16 `mask_dtype` halves the memory; with transformers 5.24 a bf16 model accepted
      float32 and bf16 masks alike (sdpa and eager), with the same loss.
      Memory: B*T*T elements, e.g. 8 rows of 4096 tokens in float32 = 512 MiB, in bf16 = 256 MiB.
    - Packed rows, "flash_attention_2": the rows are concatenated into ONE row of shape (1, N) (no
      padding between rows; `pad_to_multiple_of` pads the end) and no attention_mask is returned: the
      varlen kernel finds example boundaries where position_ids restart at 0. One row because
      transformers (5.24, `_is_packed_sequence`) infers boundaries from position_ids only at batch size 1.
    - `masks` (Plan.attention_masks): the mask kind each attention layer type needs in packed rows (sliding windows,
      chunks; `layer_masks`); `sample_index` (Plan.sample_index): varlen rows also carry `seq_idx`.
    """
    if not rows:
        raise DataError("cannot collate an empty batch")
    packed = ["seq_lens" in r for r in rows]
    if any(packed) and not all(packed):
        raise DataError("a batch mixes packed rows (with seq_lens) and unpacked rows")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise DataError(f"pad_to_multiple_of must be at least 1, got {pad_to_multiple_of}")
    for i, row in enumerate(rows):
        _check_row(i, row)
    if packed[0] and attn_implementation not in MASK_IMPLS + VARLEN_IMPLS:
        raise DataError(
            f"packed rows are not supported with attn_implementation={attn_implementation!r}; "
            f"use one of {', '.join(MASK_IMPLS + VARLEN_IMPLS)} or turn packing off"
        )
    varlen = packed[0] and attn_implementation in VARLEN_IMPLS
    if varlen:
        rows = [_flatten(rows)]
    length = max(len(r["input_ids"]) for r in rows)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out = _pad_tensors(rows, pad_id, length)
    if varlen:
        del out["attention_mask"]
        out.update(varlen_boundaries(rows[0]["seq_lens"], length, sample_index))
    elif packed[0]:
        # sdpa takes a boolean mask, which is cheaper than an additive one (measured: about 30% less
        # step time on CPU); eager only understands the additive form
        dtype = torch.bool if attn_implementation == "sdpa" and mask_dtype == torch.float32 else mask_dtype
        out["attention_mask"] = layer_masks(segment_ids(rows, length), masks or {}, dtype)
    return out
