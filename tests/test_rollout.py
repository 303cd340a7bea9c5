"""Rollouts without vLLM: the data stream's repeats, when the driver syncs and generates (several updates per rollout,
one step off-policy), what a checkpoint carries. The client of a vLLM rollout server: tests/test_rollout_client.py.

vLLM itself is exercised in tests/test_vllm_rollout.py (the vLLM environment)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from finetune.config.methods import GRPOMethod, RewardSpec
from finetune.data.stream import Stream, steps_for
from finetune.distributed.runtime import Runtime
from finetune.rollout import Completion
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
        lambda version: SimpleNamespace(version=version, kind="full"),
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
    assert state["ahead"]["indices"] == stream.peek() and state["ahead"]["version"] == 6
    saved = json.loads(json.dumps(state))  # plain data: what torch.save(weights_only) stores
    resumed = _driver(FakeEngine(), asynchronous=True, upcoming=stream.peek, steps_per_batch=2)
    resumed.load_state_dict(saved)
    rows = stream.next_step()
    again = resumed.rollout(8, rows, [[i] for i in rows])
    assert again.completions == [[106, state["ahead"]["completions"][0][1]]] * len(rows)  # made before the stop
    assert resumed.engine.updates == [8]  # and the engine gets the checkpoint's weights before the next one
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
