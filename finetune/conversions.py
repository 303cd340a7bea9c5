"""The checkpoint tensors of parameters that transformers converts while loading, for ft's sharded loading.

transformers 5 stores a mixture-of-experts layer's routed experts as fused 3-D parameters (`experts.gate_up_proj`,
shape (experts, 2·I, H); `experts.down_proj`, (experts, H, I)), while checkpoints, its own save_pretrained's included,
hold one matrix per expert and projection (`mlp.experts.3.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.3.w1.weight`). from_pretrained converts them with the family's conversion mapping
(transformers/conversion_mapping.py): a `WeightConverter` whose `MergeModulelist(dim=0)` stacks the experts and whose
`Concatenate(dim=1)` joins gate and up, and `WeightRenaming`s of whole names. Sharded loading (FSDP2's meta device,
ZeRO-3's partitions) reads each rank's rows itself (models.Checkpoint), so `sources` reads the same mapping: a renamed
tensor is found under its checkpoint name, and a fused expert parameter gets a `Stacked` view whose row e is expert e's
matrices one after the other, read one expert at a time (a rank reads only its own experts). Converters with other
operations (transposes, interleaving) are not read: their parameters stay missing and models.checkpoint_keys says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_PLAIN = re.compile(r"[\w.]+")  # a pattern that names keys literally (dots aside)


@dataclass(frozen=True)
class Stacked:
    """A fused expert parameter: expert e is the rows of checkpoint tensors `parts[e]`, one after the other."""

    parts: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]
    dtype: Any  # the checkpoint's dtype (torch.dtype)

    def read(self, ckpt, start: int, stop: int, out=None):
        """Experts [start, stop) as one CPU tensor in the checkpoint's dtype (into `out` when given: contiguous, that
        dtype and shape), each projection's matrix read straight into its rows."""
        import torch

        buf = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype) if out is None else out
        for i, keys in enumerate(self.parts[start:stop]):
            row = 0
            for key in keys:
                n = ckpt.shape(key)[0]
                ckpt.read(key, out=buf[i, row : row + n])
                row += n
        return buf


def sources(missing: dict[str, tuple[int, ...]], net, ckpt, prefix: str = "") -> dict[str, Any]:
    """For each parameter name in `missing` (name -> shape) that the checkpoint holds under the conversions
    transformers applies to the model `net` while loading (get_model_conversion_mapping: its own and its sub-models',
    each scoped to its part, as a vision-language model's language model and tower): its checkpoint key (a renamed
    tensor, found by transformers' own rename_source_key) or a `Stacked` view (fused experts). `prefix`: the model's
    base_model_prefix, which checkpoints may or may not carry."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(net) or []
    renamed = [r for r in mapping if isinstance(r, WeightRenaming)]
    forward = {}  # model name -> checkpoint key, as from_pretrained renames each checkpoint key
    for key in ckpt.entries:
        name, _ = rename_source_key(key, renamed, [], prefix or None, missing)
        forward.setdefault(name, key)
    renames = [
        (r.source_patterns[0].replace("\\.", "."), r.target_patterns[0])
        for r in mapping
        if type(r) is WeightRenaming
        and all(_PLAIN.fullmatch(p.replace("\\.", ".")) for p in (*r.source_patterns, *r.target_patterns))
    ]
    converters = [c for c in mapping if isinstance(c, WeightConverter) and _stacks(c)]
    out: dict[str, Any] = {}
    for name, shape in missing.items():
        key = forward.get(name) if forward.get(name) != name else None
        key = key or _find(ckpt, name, renames, prefix)
        if key is not None:
            out[name] = key
            continue
        for conv in converters:
            target = conv.target_patterns[0]
            if target in name and len(shape) == 3:
                found = _stacked(ckpt, name, target, conv.source_patterns, shape, renames, prefix)
                if found is not None:
                    out[name] = found
                    break
    return out


def _stacks(conv) -> bool:
    """A converter that stacks per-expert matrices (MergeModulelist(dim=0)), joining several projections row-wise
    (Concatenate(dim=1) of the stacks)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = [(type(op), getattr(op, "dim", None)) for op in conv.operations]
    shapes = ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)])
    plain = all(p.count("*") == 1 and _PLAIN.fullmatch(p.replace("*", "0")) for p in conv.source_patterns)
    return (
        ops in shapes
        and len(conv.target_patterns) == 1
        and plain
        and (len(ops) == 2) == (len(conv.source_patterns) > 1)
    )


def _stacked(ckpt, name: str, target: str, patterns, shape, renames, prefix: str) -> Stacked | None:
    before, _, after = name.partition(target)
    parts = []
    for e in range(shape[0]):
        keys = tuple(_find(ckpt, before + p.replace("*", str(e)) + after, renames, prefix) for p in patterns)
        if None in keys:
            return None
        parts.append(keys)
    if sum(ckpt.shape(k)[0] for k in parts[0]) != shape[1] or ckpt.shape(parts[0][0])[1:] != tuple(shape[2:]):
        return None
    return Stacked(tuple(parts), tuple(shape), ckpt.dtype(parts[0][0]))


def _find(ckpt, key: str, renames, prefix: str) -> str | None:
    """The checkpoint's name for `key`: as is, renamed back (a renaming's target replaced by its source), with or
    without the base model prefix."""
    candidates = [key] + [key.replace(target, source) for source, target in renames if target in key]
    for k in candidates:
        for variant in (k, f"{prefix}.{k}", k.removeprefix(f"{prefix}.")):
            if variant in ckpt.entries:
                return variant
    return None
