"""Batches of prompts, formed once for the whole job and then dealt to the processes.

Because the batches do not depend on the number of processes, each prompt is generated in the same
batch, with the same padding and the same seed, whether one process or eight run the job: greedy output
is identical, and a batch is the unit of resume.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan(lengths: Sequence[int], batch_size: int, sort: bool = True) -> list[list[int]]:
    """Prompt indices in batches of `batch_size`: longest first when `sort` (ties in input order), else input order.

    Sorting puts prompts of similar length together, so little of each batch is padding; longest first
    makes a batch that does not fit in memory fail at the start rather than at the end.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort else list(range(len(lengths)))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def deal(batches: Sequence[int], rank: int, world: int) -> list[int]:
    """This process's share of the batches still to do: every world-th, starting at its rank."""
    return list(batches[rank::world])


def padding_share(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Fraction of the prompt positions in the batches that are padding."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    return 1 - sum(lengths[i] for b in batches for i in b) / padded if padded else 0.0
