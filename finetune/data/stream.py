"""Which rows each optimizer step trains on: a seeded, resumable stream over epochs, split over ranks.

The stream is the concatenation of one random permutation of the rows per epoch (seeded by
seed + epoch). Step k takes the next `global_batch` indices; rank r takes its contiguous slice of
them. So ranks see disjoint rows, their union is the epoch, and the position (a single integer) is
all a checkpoint needs to resume exactly where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Stream:
    rows: int
    global_batch: int
    seed: int
    rank: int = 0
    world: int = 1
    position: int = 0  # rows consumed so far, over all epochs and ranks

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError("the training set is empty")
        if self.global_batch % self.world:
            raise ValueError(f"global batch {self.global_batch} is not divisible by world size {self.world}")
        self._epoch, self._perm = -1, []

    @property
    def epoch(self) -> float:
        return self.position / self.rows

    def _permutation(self, epoch: int) -> list[int]:
        import torch

        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.rows, generator=g).tolist()
        return self._perm

    def _take(self, start: int, n: int) -> list[int]:
        out = []
        while n:
            epoch, offset = divmod(start, self.rows)
            chunk = self._permutation(epoch)[offset : offset + n]
            out += chunk
            start, n = start + len(chunk), n - len(chunk)
        return out

    def next_step(self) -> list[int]:
        """This rank's row indices for the next optimizer step."""
        per_rank = self.global_batch // self.world
        indices = self._take(self.position + self.rank * per_rank, per_rank)
        self.position += self.global_batch
        return indices


def steps_for(rows: int, global_batch: int, max_steps: int | None, epochs: float | None) -> int:
    """Optimizer steps of a run: max_steps, or enough to see every row `epochs` times (default 1)."""
    if max_steps is not None:
        return max_steps
    return max(1, -(-int(round((epochs or 1.0) * rows)) // global_batch))
