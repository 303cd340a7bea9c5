"""One-step-off-policy rollouts: the next rollout is generated in a background thread while the current one trains.

Only one rollout is ever in flight, and the trainer waits for it before it sends the engine new weights, so an engine
never generates while its weights change."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class Background:
    """At most one call running in a worker thread; its result (or its exception) is taken with `result`."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-rollout")
        self._future: Future | None = None

    @property
    def busy(self) -> bool:
        return self._future is not None

    def submit(self, fn, *args) -> None:
        if self._future is not None:
            raise RuntimeError("a rollout is already in flight")
        self._future = self._pool.submit(fn, *args)

    def result(self):
        """The call's result, waiting for it; None when nothing was submitted."""
        future, self._future = self._future, None
        return None if future is None else future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
