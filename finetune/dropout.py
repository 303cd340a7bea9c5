"""LoRA dropout on a CPU that draws only the dropped positions (Plan.sparse_dropout).

peft drops out each adapter's input with `nn.Dropout`. On a CPU, torch draws one random number per element of that
input (`bernoulli_`, ~5 ns an element on one core) and then makes two more passes over it (scale, multiply): on a small
model that costs about what every matrix product costs (a packed LoRA SFT step of a 4-layer, width-256 Llama with
dropout 0.05 on its seven projections: `bernoulli_` 18% of the step and multiplications 14%, all matrix products 37%).

`SparseDropout` keeps the same distribution, each element dropped on its own with probability p and the rest scaled by
1 / (1 - p), and draws only where the drops fall: the gaps between consecutive dropped elements of a flattened input
are geometric, so about p·n uniform numbers give every dropped position (inverse transform, float64). The kept
elements are scaled in one pass and the dropped ones zeroed in place; the backward pass does the same to the gradient.

Random numbers come from torch's default CPU generator, whose state ft's checkpoints keep and which
torch.utils.checkpoint restores before a layer recomputes: a resumed run and a recomputed layer draw the same drops.
On a GPU, torch's fused dropout kernel costs about one pass over the input and ft keeps peft's module.
"""

from __future__ import annotations

import math

import torch


def dropped_positions(n: int, p: float, draw: int | None = None) -> torch.Tensor:
    """Sorted int64 indices of the elements of an n-element tensor that dropout with probability `p` drops: each index
    independently with probability p. Draws the gaps between them (failures before a success, geometric with
    parameter p) by inverse transform, `draw` at a time (default: about n·p, more in the rare case those end short)."""
    if n <= 0 or p <= 0.0:
        return torch.empty(0, dtype=torch.long)
    if p >= 1.0:
        return torch.arange(n)
    log_keep = math.log1p(-p)
    mean = n * p
    draw = draw or int(mean + 6.0 * math.sqrt(mean) + 16)  # enough gaps to pass n but for a 6-sigma shortfall
    parts, start = [], 0
    while True:
        u = 1.0 - torch.rand(draw, dtype=torch.float64)  # (0, 1]
        gaps = torch.floor(torch.log(u) / log_keep).long()  # P(gap >= k) = (1 - p) ** k
        positions = (gaps + 1).cumsum(0) + (start - 1)
        end = int(torch.searchsorted(positions, n))
        parts.append(positions[:end])
        if end < draw:
            break
        start = int(positions[-1]) + 1
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _Drop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        dropped = dropped_positions(x.numel(), p)
        ctx.save_for_backward(dropped)
        ctx.scale = 1.0 / (1.0 - p)
        out = (x * ctx.scale).contiguous()
        out.view(-1).index_fill_(0, dropped, 0)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (dropped,) = ctx.saved_tensors
        out = (grad * ctx.scale).contiguous()
        out.view(-1).index_fill_(0, dropped, 0)
        return out, None


class SparseDropout(torch.nn.Module):
    """`nn.Dropout(p)` (element-wise, scaled; the identity in eval mode) that draws only the dropped positions."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or x.numel() == 0:
            return x
        return _Drop.apply(x, self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def use_sparse_dropout(model) -> int:
    """Replace every peft LoRA layer's `nn.Dropout` with `SparseDropout` of the same p; returns how many."""
    count = 0
    for module in model.modules():
        drops = getattr(module, "lora_dropout", None)
        if not isinstance(drops, torch.nn.ModuleDict):
            continue
        for name, drop in list(drops.items()):
            if isinstance(drop, torch.nn.Dropout) and drop.p > 0:
                drops[name] = SparseDropout(drop.p)
                drops[name].train(drop.training)
                count += 1
    return count
