"""Rollouts without vLLM: the data stream's repeats, when the driver syncs and generates (several updates per rollout,
one step off-policy, several rollouts ahead, across weight updates), what a checkpoint carries. The client of a vLLM
rollout server: tests/test_rollout_client.py.

vLLM itself is exercised in tests/test_vllm_rollout.py (the vLLM environment)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import torch

from finetune.config.methods import GRPOMethod, RewardSpec
from finetune.data.stream import Stream, steps_for
from finetune.distributed.runtime import Runtime
from finetune.rollout import Completion, sampling_seed
from finetune.rollout.driver import RolloutDriver


# ---------------------------------------------------------------- the data stream
def test_a_repeated_batch_is_dealt_for_that_many_steps_and_the_next_one_can_be_peeked():
    plain, twice = Stream(10, 4, seed=1), Stream(10, 4, seed=1, repeat=2)
    batches = [plain.next_step() for _ in range(3)]
    peeked = twice.peek()
    dealt = [twice.next_step() for _ in range(6)]
    assert peeked == batches[0]
    assert dealt == [batches[0], batches[0], batches[1], batches[1], batches[2], batches[2]]
    assert twice.position == plain.position  # the epoch advances per batch, not per step
    resumed = Stream(10, 4, seed=1, repeat=2, position=twice.position, served=1)  # saved after the 1st of 2
    assert resumed.next_step() == batches[2] and resumed.next_step() != batches[2]
    assert steps_for(10, 4, None, 1.0, repeat=2) == 2 * steps_for(10, 4, None, 1.0)


# ---------------------------------------------------------------- the driver
class FakeEngine:
    """Completions that say which weights made them: token = 100 + the version last received."""

    name = "fake"

    def __init__(self, logps: bool = True):
        self.version, self.updates, self.sleeps, self.logps = 0, [], 0, logps

    def generate(self, prompts, seed):
        return [Completion([100 + self.version, seed % 50], [-0.5, -0.25] if self.logps else None) for _ in prompts]

    def update(self, weights):
        self.version = weights.version
        self.updates.append(weights.version)

    def sleep(self, reloading=False):
        self.sleeps += 1

    def wake(self):
        pass

    def close(self):
        pass


def _driver(engine, **kw):
    return RolloutDriver(
        engine,
        lambda version, in_flight=(): SimpleNamespace(version=version, kind="full", in_flight=in_flight),
        Runtime(),
        seed=3,
        prompts_for=lambda rows: [[r] for r in rows],
        **kw,
    )


def test_weights_reach_the_engine_every_sync_every_steps_and_always_first():
    engine = FakeEngine()
    driver = _driver(engine, sync_every=2)
    made = [driver.rollout(step, [step], [[step]]) for step in range(5)]
    assert engine.updates == [0, 2, 4]
    assert [r.version for r in made] == [0, 0, 2, 2, 4]  # step 1 and 3 sample with the weights of 0 and 2
    assert engine.sleeps == 5  # asleep while the trainer runs (synchronous rollouts)
    driver.load_state_dict({})  # a resumed run: the engine holds the checkpoint's starting weights, not the trainer's
    driver.rollout(5, [5], [[5]])
    assert engine.updates[-1] == 5


def test_asynchronous_rollouts_are_one_batch_behind_and_a_checkpoint_keeps_the_one_in_flight():
    stream = Stream(100, 2, seed=0, repeat=2)
    engine = FakeEngine()
    driver = _driver(engine, asynchronous=True, upcoming=stream.peek, steps_per_batch=2)
    versions, lags = [], []
    for step in range(0, 8, 2):  # the first step of each batch (two updates per batch)
        rows = stream.next_step()
        stream.next_step()
        r = driver.rollout(step, rows, [[i] for i in rows])
        assert r.indices == rows and r.prompts == [[i] for i in rows]
        versions.append(r.version)
        lags.append(step - r.version)
    assert lags == [0, 2, 2, 2] and versions == [0, 0, 2, 4]
    state = driver.state_dict()  # waits for the rollout generated ahead and keeps it
    (ahead,) = state["ahead"]
    assert ahead["indices"] == stream.peek() and ahead["version"] == 6
    saved = json.loads(json.dumps(state))  # plain data: what torch.save(weights_only) stores
    resumed = _driver(FakeEngine(), asynchronous=True, upcoming=stream.peek, steps_per_batch=2)
    resumed.load_state_dict({"ahead": saved["ahead"][0]})  # as a checkpoint written before max_staleness
    rows = stream.next_step()
    again = resumed.rollout(8, rows, [[i] for i in rows])
    assert again.completions == [[106, ahead["completions"][0][1]]] * len(rows)  # made before the stop
    assert resumed.engine.updates == [8]  # and the engine gets the checkpoint's weights before the next one
    driver.close()
    resumed.close()


class GatedServer(FakeEngine):
    """A rollout server: takes weights while it generates. The rollout of step s says it began (`began[s]`), then
    waits until the test opens `gates[s]`; its completion is [100 + the version it began with, 100 + the version it
    ended with]."""

    updates_while_generating = True

    def __init__(self, seed: int = 3, steps: int = 12):
        super().__init__()
        self.step_of = {sampling_seed(seed, s, 0): s for s in range(steps)}
        self.began = [threading.Event() for _ in range(steps)]
        self.gates = [threading.Event() for _ in range(steps)]
        self.finished = 0

    def generate(self, prompts, seed):
        step, started = self.step_of[seed], self.version
        self.began[step].set()
        assert self.gates[step].wait(timeout=60), f"the rollout of step {step} was never let through"
        self.finished += 1
        return [Completion([100 + started, 100 + self.version], [-0.5, -0.25]) for _ in prompts]


def test_a_server_generates_max_staleness_rollouts_ahead_across_weight_updates_and_records_the_older_version():
    stream, engine = Stream(100, 2, seed=0), GatedServer()
    driver = _driver(engine, asynchronous=True, upcoming=stream.peek, max_staleness=2)

    def step(s: int):
        rows = stream.next_step()
        r = driver.rollout(s, rows, [[i] for i in rows])
        assert r.indices == rows
        return r

    engine.gates[0].set()  # the first rollout is generated on the spot
    assert step(0).version == 0
    assert engine.began[2].wait(timeout=60)  # the rollouts of steps 1 and 2 began with weights 0
    engine.gates[1].set()
    second = step(1)
    assert second.version == 0 and second.completions[0] == [100, 100]
    assert engine.updates == [0, 1] and engine.finished == 2  # weights 1 arrived while step 2's rollout generated
    engine.gates[2].set()
    engine.gates[3].set()
    third = step(2)
    assert third.completions[0] == [100, 101]  # it straddled the update: began with weights 0, ended with 1
    assert third.version == 0  # the older version: its lag (2) is never understated
    lags = []
    for s in range(3, 8):
        engine.gates[s + 1].set()
        lags.append(s - step(s).version)
    assert lags == [2] * 5 and engine.updates == list(range(8))
    for gate in engine.gates:
        gate.set()
    driver.close()


def test_an_engine_that_cannot_take_weights_while_generating_finishes_the_rollouts_ahead_first():
    class Colocated(FakeEngine):
        def __init__(self):
            super().__init__()
            self.busy, self.overlaps = 0, 0

        def generate(self, prompts, seed):
            self.busy += 1
            self.overlaps += self.busy > 1
            out = super().generate(prompts, seed)
            self.busy -= 1
            return out

        def update(self, weights):
            assert self.busy == 0, "weights changed while the engine generated"
            super().update(weights)

    stream, engine = Stream(100, 2, seed=0, repeat=2), Colocated()
    driver = _driver(engine, asynchronous=True, upcoming=stream.peek, steps_per_batch=2, max_staleness=3)
    lags = []
    for step in range(0, 16, 2):
        rows = stream.next_step()
        stream.next_step()
        r = driver.rollout(step, rows, [[i] for i in rows])
        assert r.indices == rows
        lags.append(step - r.version)
    assert lags == [0, 2, 4, 6, 6, 6, 6, 6] and engine.overlaps == 0
    driver.close()


def test_a_checkpoint_keeps_every_rollout_ahead_and_a_resumed_run_trains_on_them():
    stream, engine = Stream(100, 2, seed=0), FakeEngine()
    engine.updates_while_generating = True
    driver = _driver(engine, asynchronous=True, upcoming=stream.peek, max_staleness=2)
    for step in range(3):
        rows = stream.next_step()
        driver.rollout(step, rows, [[i] for i in rows])
    state = json.loads(json.dumps(driver.state_dict()))  # waits for both rollouts ahead
    assert [a["indices"] for a in state["ahead"]] == [stream.peek(0), stream.peek(1)]
    assert [a["version"] for a in state["ahead"]] == [1, 2]
    later = [driver.rollout(s, r, [[i] for i in r]) for s, r in ((3, stream.peek(0)), (4, stream.peek(1)))]
    resumed_engine = FakeEngine()
    resumed_engine.updates_while_generating = True
    resumed = _driver(resumed_engine, asynchronous=True, upcoming=stream.peek, max_staleness=2)
    resumed.load_state_dict(state)
    again = [resumed.rollout(s, r, [[i] for i in r]) for s, r in ((3, stream.peek(0)), (4, stream.peek(1)))]
    assert [(r.version, r.completions) for r in again] == [(r.version, r.completions) for r in later]
    assert resumed_engine.updates == [3, 4]  # the checkpoint's weights first
    driver.close()
    resumed.close()


# ---------------------------------------------------------------- GRPO's several updates per rollout
def test_later_steps_on_a_rollout_reuse_it_and_compare_with_the_policy_that_made_it():
    from transformers import AutoModelForCausalLM

    from finetune.methods.grpo import GRPO
    from finetune.tiny import ensure_model

    model = AutoModelForCausalLM.from_pretrained(str(ensure_model()))
    section = GRPOMethod(
        name="grpo", rewards=[RewardSpec(function="exact_match")], num_generations=2, num_iterations=2, clip_eps=0.05
    )
    engine = FakeEngine(logps=False)  # as the training model samples
    driver = RolloutDriver(engine, None, Runtime(), seed=0)

    def policy(batch):
        with torch.no_grad():
            return GRPO(section, Tok(), 4, None, None, []).policy_score(model, batch)

    method = GRPO(section, Tok(), 4, driver, None, [AlternatingReward()], policy=policy)
    dataset = prompt_rows(4)
    first = method.micro_batches(dataset, [0, 1])
    assert "old_logps" in first[0] and "is_weight" not in first[0]  # the trainer sampled: no engine mismatch
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the update of the first step
    second = method.micro_batches(dataset, [0, 1])
    assert len(engine.updates) == 0 and second[0]["input_ids"] is first[0]["input_ids"]  # no new rollout
    _, fresh = method.loss(model, {k: v for k, v in second[0].items() if k != "old_logps"}, 1.0)
    _, reused = method.loss(model, second[0], 1.0)
    assert fresh["clip_fraction"] == 0 < reused["clip_fraction"]  # the ratio is not 1 on the second step
    third = method.micro_batches(dataset, [2, 3])
    assert third[0]["input_ids"] is not first[0]["input_ids"]
    state = method.state_dict()
    assert state["pending"]["left"] == 1


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row)) for row in ids]


class AlternatingReward:
    """1 for every other completion: each group has a better and a worse half."""

    name, weight = "alternating", 1.0

    def __call__(self, texts, prompts, columns, origins):
        return [float(i % 2) for i in range(len(texts))]


def prompt_rows(n: int):
    import datasets

    return datasets.Dataset.from_dict(
        {
            "prompt_ids": [[5 + i, 6, 7] for i in range(n)],
            "extra": ["{}"] * n,
            "prompt": ['[{"role": "user", "content": "q"}]'] * n,
        }
    )


def test_asynchronous_rollouts_need_an_engine_other_than_the_training_model():
    section = GRPOMethod(
        name="grpo",
        rewards=[RewardSpec(function="exact_match")],
        engine="transformers",
        rollout={"asynchronous": True, "url": "node7:8420"},
    )
    problems = section.problems()
    assert [p.keys[0] for p in problems] == [("method", "rollout", "asynchronous"), ("method", "rollout", "url")]
    assert "engine: vllm" in problems[0].fix and "http://" in problems[1].fix


def test_rollouts_ahead_need_asynchronous_rollouts():
    section = GRPOMethod(name="grpo", rewards=[RewardSpec(function="exact_match")], rollout={"max_staleness": 2})
    (problem,) = section.problems()
    assert problem.keys == (("method", "rollout", "max_staleness"), ("method", "rollout", "asynchronous"))
    assert "asynchronous: true" in problem.fix
    fine = GRPOMethod(
        name="grpo", rewards=[RewardSpec(function="exact_match")], rollout={"max_staleness": 2, "asynchronous": True}
    )
    assert fine.problems() == []
