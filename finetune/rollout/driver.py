"""When rollouts are generated and when the engine receives new weights.

A rollout is generated at the first step of each batch (GRPO's num_iterations reuse it for the steps after). Before it
generates, the engine gets the trainer's weights when `sync_every` steps have passed since it last did (and always the
first time, also after a resume). With `asynchronous`, the next batch's rollout is generated in the background, with the
weights the engine has now, while this batch trains: it is one batch behind the policy (the lag is logged). A rollout
that is in flight when a checkpoint is written is waited for and saved with it, so a resumed run trains on the same
rollouts as an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from finetune.rollout import sampling_seed
from finetune.rollout.prefetch import Background


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
        weights: Callable[[int], object] | None,  # version -> rollout.weights.Weights; None: the engine is the trainer
        runtime,
        seed: int,
        sync_every: int = 1,
        asynchronous: bool = False,
        prompts_for: Callable[[list[int]], list[list[int]]] | None = None,
        upcoming: Callable[[], list[int]] | None = None,  # this rank's rows of the next batch (asynchronous)
        steps_per_batch: int = 1,
    ):
        self.engine, self.weights, self.runtime, self.seed = engine, weights, runtime, seed
        self.sync_every, self.asynchronous, self.steps_per_batch = sync_every, asynchronous, steps_per_batch
        self.prompts_for, self.upcoming = prompts_for, upcoming
        self.synced: int | None = None  # the version the engine holds (None: the checkpoint's weights, not yet sent)
        self.sync_seconds = 0.0
        self.background = Background() if asynchronous else None
        self.ahead: Rollout | None = None  # a finished background rollout (restored from a checkpoint, or waited for)

    def rollout(self, step: int, indices: list[int], prompts: list[list[int]]) -> Rollout:
        """The rollout of the batch that starts at optimizer step `step` (the policy's version)."""
        ready = self._take_ahead(indices)
        self.sync_seconds = 0.0
        if self._updates_at(step):
            started = time.perf_counter()
            self.engine.update(self.weights(step))
            self.synced, self.sync_seconds = step, time.perf_counter() - started
        if ready is None:
            ready = self._generate(indices, prompts, step, self.synced if self.weights is not None else step)
        if self.background is not None and self.upcoming is not None:
            after = step + self.steps_per_batch
            rows = self.upcoming()
            self.background.submit(self._generate, rows, self.prompts_for(rows), after, self.synced)
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
        if self.background is not None and self.background.busy:
            self.ahead = self.background.result()
        ahead, self.ahead = self.ahead, None
        return ahead if ahead is not None and ahead.indices == indices else None

    def state_dict(self) -> dict:
        if self.background is not None and self.background.busy:
            self.ahead = self.background.result()
        return {"ahead": asdict(self.ahead) if self.ahead is not None else None}

    def load_state_dict(self, state: dict) -> None:
        ahead = state.get("ahead")
        self.ahead = Rollout(**ahead) if ahead else None
        self.synced = None  # the engine starts from the checkpoint's weights: send them before generating

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
        self.engine.close()
