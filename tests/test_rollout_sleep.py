"""The sleep level of a colocated vLLM engine between rollouts, without vLLM (a stand-in for its LLM object; sleep mode
itself is a GPU feature, tests/test_gpu_rollout.py): level 2, the weights dropped, where a model trained in full gets
its weights again before the next generation; level 1 for a LoRA adapter, served on base weights never sent again, and
wherever the next rollout does not update the weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune.distributed.runtime import Runtime
from finetune.rollout import Completion
from finetune.rollout.driver import RolloutDriver
from finetune.rollout.vllm import EngineSpec, VllmRollout


class StandInLLM:
    """Records what the engine asks of vLLM's LLM."""

    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, sorted(n for n, _ in kwargs["weights_iterator"])))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def engine(lora_rank: int = 0, sleep: bool = True) -> VllmRollout:
    spec = EngineSpec(model="m", tokenizer="m", dtype="bf16", max_model_len=64, lora_rank=lora_rank, sleep=sleep)
    return VllmRollout(spec, llm=StandInLLM())


def full_weights(version: int):
    return SimpleNamespace(kind="full", version=version, tensors=lambda: iter([("w", 1), ("b", 2)]))


def test_full_fine_tuning_drops_its_weights_while_asleep_and_takes_the_trainers_at_the_next_update():
    e = engine()
    e.sleep(reloading=True)
    assert e.llm.calls == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="slept at level 2"):  # never samples with the dropped weights
        e.sample([[1, 2]], 0, temperature=1.0, top_p=1.0, max_new_tokens=4, stop=[])
    e.sleep(reloading=True)
    e.update(full_weights(1))
    assert e.llm.calls[-2:] == [("reload_weights", ["b", "w"]), ("reset_prefix_cache",)]
    e.sleep(reloading=False)  # the next rollout keeps these weights (method.rollout.sync_every): keep them
    assert e.llm.calls[-1] == ("sleep", 1)


def test_an_adapter_keeps_its_base_weights_and_an_engine_without_sleep_mode_stays_awake():
    lora = engine(lora_rank=8)
    lora.sleep(reloading=True)
    assert lora.llm.calls == [("sleep", 1)]
    awake = engine(sleep=False)
    awake.sleep(reloading=True)
    assert awake.llm.calls == []


class Recorder:
    name = "recorder"

    def __init__(self):
        self.reloading, self.updates = [], []

    def generate(self, prompts, seed):
        return [Completion([7], [-0.5]) for _ in prompts]

    def update(self, weights):
        self.updates.append(weights.version)

    def sleep(self, reloading=False):
        self.reloading.append(reloading)


@pytest.mark.parametrize(
    "sync_every,per_batch,expected",
    [(1, 1, [True] * 4), (2, 1, [False, True, False, True]), (2, 2, [True] * 4), (3, 1, [False, False, True, False])],
)
def test_the_driver_says_when_the_next_rollout_loads_the_weights_first(sync_every, per_batch, expected):
    rec = Recorder()
    weights = lambda version, in_flight=(): SimpleNamespace(version=version, kind="full")  # noqa: E731
    driver = RolloutDriver(rec, weights, Runtime(), 0, sync_every=sync_every, steps_per_batch=per_batch)
    steps = range(0, 4 * per_batch, per_batch)
    for step in steps:
        driver.rollout(step, [step], [[step]])
    assert rec.reloading == expected
    # each promise holds: a rollout told "reloading" is followed by an update before the next generation
    updated = [step in rec.updates for step in steps]
    assert all(updated[i + 1] for i, said in enumerate(rec.reloading[:-1]) if said)
