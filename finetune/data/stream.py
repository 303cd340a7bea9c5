"""Which rows each optimizer step trains on: a seeded, resumable stream over epochs, split over ranks.

The stream is the concatenation of one random permutation of the rows per epoch (seeded by
seed + epoch). Step k takes the next `global_batch` indices; rank r takes its contiguous slice of
them. So ranks see disjoint rows, their union is the epoch, and the position (a single integer) is
all a checkpoint needs to resume exactly where it stopped. With `repeat` > 1 (GRPO's num_iterations: several
optimizer steps on one rollout) each batch is dealt for `repeat` steps in a row; `served` counts how many steps the
current batch has had, and is saved with the position.
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
    repeat: int = 1  # optimizer steps per batch of rows
    served: int = 0  # steps the current batch (the last `global_batch` rows before `position`) has been dealt for

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
        """This rank's row indices for the next optimizer step (the same rows `repeat` steps in a row)."""
        per_rank = self.global_batch // self.world
        if 0 < self.served < self.repeat:
            self.served += 1
            return self._take(self.position - self.global_batch + self.rank * per_rank, per_rank)
        indices = self._take(self.position + self.rank * per_rank, per_rank)
        self.position += self.global_batch
        self.served = 1
        return indices

    def peek(self, ahead: int = 0) -> list[int]:
        """This rank's row indices of the next new batch (the one after the current batch's repeats), or of the
        `ahead`-th batch after that, without taking them."""
        per_rank = self.global_batch // self.world
        return self._take(self.position + ahead * self.global_batch + self.rank * per_rank, per_rank)


def steps_for(rows: int, global_batch: int, max_steps: int | None, epochs: float | None, repeat: int = 1) -> int:
    """Optimizer steps of a run: max_steps, or enough to see every row `epochs` times (default 1), each batch for
    `repeat` steps."""
    if max_steps is not None:
        return max_steps
    return repeat * max(1, -(-int(round((epochs or 1.0) * rows)) // global_batch))
