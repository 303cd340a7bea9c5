"""When rollouts are generated and when the engine receives new weights.

A rollout is generated at the first step of each batch (GRPO's num_iterations reuse it for the steps after). Before it
generates, the engine gets the trainer's weights when `sync_every` steps have passed since it last did (and always the
first time, also after a resume). With `asynchronous`, the rollouts of the next `max_staleness` batches are generated
in the background, each with the weights the engine has when it starts, while this batch trains; the lag (optimizer
steps between those weights and the trained ones) is logged. An engine that cannot take weights while it generates (a
colocated one) generates one rollout at a time and finishes every rollout ahead before it receives weights; a rollout
server (`updates_while_generating`) keeps generating and takes the weights between two of its own steps, so a
rollout that straddles an update has tokens of both versions and records the older (its lag is never understated).
The rollouts ahead when a checkpoint is written are waited for and saved with it: a resumed run trains on the same
rollouts as the run that wrote the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from finetune.rollout import sampling_seed
from finetune.rollout.prefetch import Ahead


@dataclass
class Rollout:
    """The completions of one batch of prompts, and which policy generated them."""

    indices: list[int]  # this rank's dataset rows
    prompts: list[list[int]]  # prompt ids, each repeated for its group
    completions: list[list[int]]
    logps: list[list[float]] | None  # the engine's log-prob of each completion token (None: the trainer sampled)
    version: int  # optimizer steps the generating weights had taken
    seconds: float  # generation time


class RolloutDriver:
    def __init__(
        self,
        engine,
        weights: Callable[..., object] | None,  # (version, in_flight) -> rollout.weights.Weights; None: the trainer
        runtime,
        seed: int,
        sync_every: int = 1,
        asynchronous: bool = False,
        prompts_for: Callable[[list[int]], list[list[int]]] | None = None,
        upcoming: Callable[[int], list[int]] | None = None,  # this rank's rows of the batch `i` after the next one
        steps_per_batch: int = 1,
        max_staleness: int = 1,  # asynchronous: rollouts generated ahead
    ):
        self.engine, self.weights, self.runtime, self.seed = engine, weights, runtime, seed
        self.sync_every, self.asynchronous, self.steps_per_batch = sync_every, asynchronous, steps_per_batch
        self.prompts_for, self.upcoming, self.max_staleness = prompts_for, upcoming, max_staleness
        self.synced: int | None = None  # the version the engine holds (None: the checkpoint's weights, not yet sent)
        self.sync_seconds = 0.0
        self.concurrent = bool(getattr(engine, "updates_while_generating", False))
        self.workers = max_staleness if self.concurrent else 1  # rollouts generating at once
        self.ahead = Ahead(self.workers) if asynchronous else None  # the rollouts of the next batches, oldest first

    def rollout(self, step: int, indices: list[int], prompts: list[list[int]]) -> Rollout:
        """The rollout of the batch that starts at optimizer step `step` (the policy's version)."""
        ready = self._take_ahead(indices)
        self.sync_seconds = 0.0
        if self._updates_at(step):
            if self.ahead is not None and not self.concurrent:
                self.ahead.results()  # the engine never takes weights while it generates
            started = time.perf_counter()
            in_flight = frozenset(self.ahead.versions()) if self.ahead is not None else frozenset()
            self.engine.update(self.weights(step, in_flight))
            self.synced, self.sync_seconds = step, time.perf_counter() - started
        if ready is None:
            ready = self._generate(indices, prompts, step, self.synced if self.weights is not None else step)
        if self.ahead is not None and self.upcoming is not None:
            while len(self.ahead) < self.max_staleness:
                i = len(self.ahead)  # the batch after the next i
                rows = self.upcoming(i)
                after = step + (i + 1) * self.steps_per_batch
                self.ahead.submit(self.synced, self._generate, rows, self.prompts_for(rows), after, self.synced)
        else:  # the trainer's forward and backward passes get the memory (GPUs); the next rollout comes a batch later
            self.engine.sleep(reloading=self._updates_at(step + self.steps_per_batch))
        return ready

    def _updates_at(self, step: int) -> bool:
        """Whether the engine gets the trainer's weights before the rollout at `step` (and at any later step)."""
        return self.weights is not None and (self.synced is None or step - self.synced >= self.sync_every)

    def _generate(self, indices: list[int], prompts: list[list[int]], key: int, version: int) -> Rollout:
        started = time.perf_counter()
        out = self.engine.generate(prompts, sampling_seed(self.seed, key, self.runtime.rank))
        logps = [c.logps for c in out] if all(c.logps is not None for c in out) else None
        return Rollout(indices, prompts, [c.ids for c in out], logps, version, time.perf_counter() - started)

    def _take_ahead(self, indices: list[int]) -> Rollout | None:
        """The rollout generated ahead for these rows; a queue made for other rows (not the stream's order) is
        dropped."""
        if self.ahead is None:
            return None
        ahead = self.ahead.take()
        if ahead is not None and ahead.indices != indices:
            self.ahead.results()
            self.ahead.close()
            self.ahead = Ahead(self.workers)
            return None
        return ahead

    def state_dict(self) -> dict:
        queue = self.ahead.results() if self.ahead is not None else []
        return {"ahead": [asdict(r) for r in queue]}

    def load_state_dict(self, state: dict) -> None:
        ahead = state.get("ahead") or []
        if isinstance(ahead, dict):  # a checkpoint of one rollout ahead, as written before max_staleness
            ahead = [ahead]
        if self.ahead is not None:
            for r in ahead[: self.max_staleness]:
                self.ahead.put(Rollout(**r))
        self.synced = None  # the engine starts from the checkpoint's weights: send them before generating

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        self.engine.close()
