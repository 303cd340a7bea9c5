"""Asynchronous rollouts: the rollouts of the next batches, generated in background threads while the current batch
trains, kept in the order the batches come.

`workers` threads generate at once: one for an engine that must not change weights while it generates (a colocated
engine; the driver waits for every rollout ahead before it sends weights), up to `max_staleness` for a rollout server
(its requests keep flowing while the trainer steps and while it receives weights)."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor


class Ahead:
    """A queue of rollouts: calls running in worker threads, or results already at hand (restored from a
    checkpoint). `take` returns the oldest (waiting for it; its exception is raised there)."""

    def __init__(self, workers: int = 1):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ft-rollout")
        self._queue: deque = deque()
        self._versions: deque = deque()  # the weights each rollout started with

    def __len__(self) -> int:
        return len(self._queue)

    def versions(self) -> list[int]:
        """The version of the weights each rollout in the queue started with, oldest first."""
        return list(self._versions)

    def submit(self, version: int, fn, *args) -> None:
        self._queue.append(self._pool.submit(fn, *args))
        self._versions.append(version)

    def put(self, result) -> None:
        """A rollout already made (a resumed run's, from its checkpoint)."""
        self._queue.append(result)
        self._versions.append(result.version)

    def take(self):
        """The oldest rollout, waiting for it; None when the queue is empty."""
        if not self._queue:
            return None
        head = self._queue.popleft()
        self._versions.popleft()
        return head.result() if isinstance(head, Future) else head

    def results(self) -> list:
        """Every rollout in the queue, waiting for those still generating; the queue keeps them (as results)."""
        done = []
        while self._queue:
            done.append(self.take())
        for result in done:
            self.put(result)
        return done

    def close(self) -> None:
        self._queue.clear()
        self._versions.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
