"""Rollout engines: what samples completions for online methods (GRPO), and how the trainer's weights reach it.

local.py      transformers' `generate` on the training model itself (`placement: inline`)
vllm.py       a vLLM engine in this process (`placement: colocated`), weights pushed in place or as a new LoRA
serve.py      the `vllm serve` command for a job (`placement: server`: vLLM's own server on its own devices)
server.py     the trainer's client of that server: vLLM's OpenAI API, LoRA loading and weight routes
pool.py       the server `ft train` starts next to the trainer (`placement: server`; `placement: ray` starts its
              servers as Ray actors: rollout/ray_run.py)
weights.py    the trainer's side of a weight update: the adapter as files, or full tensors one at a time
prefetch.py   asynchronous rollouts: the next batches' rollouts generate while the current one trains

Every engine takes prompts as token ids and returns each completion's token ids and, where the engine is not the
training model, the log-probability it gave each sampled token (for the importance-sampling correction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Completion:
    """One sampled completion: its token ids (up to and including the first stop token) and the engine's log-prob of
    each (None where the training model sampled it: the trainer computes its own)."""

    ids: list[int]
    logps: list[float] | None = None


class RolloutEngine(Protocol):
    """What GRPO asks of whatever samples its completions."""

    name: str

    def generate(self, prompts: list[list[int]], seed: int) -> list[Completion]:
        """Sample one completion per prompt (prompts repeat for a group), seeded by `seed`."""
        ...

    def update(self, weights) -> None:
        """Take the trainer's current weights (a weights.Weights: an adapter folder or full tensors)."""
        ...

    def sleep(self, reloading: bool = False) -> None:
        """Free the engine's device memory until the next `wake` (vLLM sleep mode on GPUs; nothing elsewhere).
        `reloading`: the trainer's weights are sent again before the engine next generates."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's rollout at one step: the same on a resumed run, different on every rank and step."""
    return (seed * 1_000_003 + step * 1_009 + rank) % 2**31
