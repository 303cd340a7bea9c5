"""GRPO's vLLM rollout engine on CPU (vLLM's CPU build): greedy rollouts equal transformers', the engine's log-probs
equal the trainer's after a training step and a weight sync (an adapter as a new LoRA request, full weights in place),
and GRPO with `engine: vllm` raises the reward on one process and two (colocated); ranks that share a tensor-parallel
engine submit the same requests to it. Rollouts through vLLM's own server: tests/test_vllm_serve.py.

Runs in an environment with vLLM (the main one has none, and this file skips there):
    OMP_NUM_THREADS=1 /path/to/vllm-env/bin/python -m pytest -q tests/test_vllm_rollout.py
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from finetune.distributed.runtime import Runtime  # noqa: E402
from finetune.rollout.vllm import EngineSpec, VllmRollout, prepare_environment  # noqa: E402
from finetune.rollout.weights import Weights  # noqa: E402
from tests.helpers import REPO, ft_train  # noqa: E402
from tests.rollout_helpers import SEQUENCES, largest_gap, one_training_step, rows, trainer_logps  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers import varied_tiny_model

    return varied_tiny_model(tmp_path_factory.mktemp("rollout-model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    """One colocated engine for the module (fp32, an adapter of rank 8 servable)."""
    prepare_environment(gpu=False)
    spec = EngineSpec(model=str(model_dir), tokenizer=str(model_dir), dtype="fp32", max_model_len=128, lora_rank=8)
    rollout = VllmRollout(spec, stop=[0])
    yield rollout
    rollout.close()


def test_greedy_rollouts_equal_transformers(engine, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompts = [s[:4] for s in SEQUENCES] + [[7, 7, 7], [150, 2]]
    ours = engine.sample(prompts, 0, 0.0, 1.0, 12, stop=[0])
    for prompt, completion in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=0)
        assert completion.ids == out[0, len(prompt) :].tolist()
        assert len(completion.logps) == len(completion.ids)


def test_an_adapter_after_a_training_step_is_served_as_a_new_lora_with_the_trainers_log_probs(
    engine, model_dir, tmp_path
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    before = trainer_logps(base, SEQUENCES)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, lora)
    trainer = one_training_step(model)
    weights = Weights(trainer, Runtime(), tmp_path / "rollout", version=1, adapter=True)
    engine.update(weights)
    after = trainer_logps(model, SEQUENCES)
    assert largest_gap(before, after) > 1e-2  # the step changed the policy
    assert largest_gap(engine.score(SEQUENCES), after) < 1e-4
    trainer2 = one_training_step(model)
    engine.update(Weights(trainer2, Runtime(), tmp_path / "rollout", version=2, adapter=True))
    assert largest_gap(engine.score(SEQUENCES), trainer_logps(model, SEQUENCES)) < 1e-4
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["adapter-00000001", "adapter-00000002"]
    engine.lora = None  # the next test trains the base in full


def test_full_weights_after_a_training_step_are_loaded_in_place_with_the_trainers_log_probs(engine, model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert model.config.tie_word_embeddings  # the tied output head reaches vLLM too
    before = trainer_logps(model, SEQUENCES)
    trainer = one_training_step(model)
    engine.update(Weights(trainer, Runtime(), ".", version=3, adapter=False))
    after = trainer_logps(model, SEQUENCES)
    assert largest_gap(before, after) > 1e-2
    assert largest_gap(engine.score(SEQUENCES), after) < 1e-4


# ---------------------------------------------------------------- GRPO end to end
def grpo_job(tmp_path, name: str, model, steps: int, extra: str = "") -> str:
    from finetune.tiny import prompt_records, write_jsonl

    prompts = write_jsonl(prompt_records(8, seed=5), tmp_path / "prompts.jsonl")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: grpo, engine: vllm, num_generations: 8, max_new_tokens: 8, rewards: [{{function: exact_match,
  args: {{column: answer}}}}, {{function: {REPO / "examples/rewards/arithmetic.py"}:digits_right, weight: 0.5}}]}}
adapter: {{type: full}}
train: {{global_batch_size: 64, micro_batch_size: 32, max_steps: {steps}, lr: 1.0e-4, scheduler: constant}}
output: {{dir: {tmp_path / name}, log_steps: 1, save_steps: 0}}
{extra}""")
    return str(path)


def rises(got: list[float], window: int) -> bool:
    return sum(got[-window:]) / window > sum(got[:window]) / window + 0.1


@pytest.mark.parametrize(
    "hardware, overrides",
    [
        ("cpu", []),
        # half as many rollouts (two updates on each) as the first: a larger step, so that 40 steps learn as much
        (
            "cpu:2",
            ["--set", "method.num_iterations=2", "--set", "method.rollout.asynchronous=true", "--set", "train.lr=4e-4"],
        ),
    ],
    ids=["one-process", "two-processes-async-two-updates-per-rollout"],
)
def test_grpo_with_vllm_rollouts_raises_the_reward(tmp_path, sft_model, hardware, overrides):
    steps = 40
    r = ft_train(grpo_job(tmp_path, "run", sft_model, steps), "--hardware", hardware, *overrides, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "run")
    assert len(got) == steps and rises([g["reward"] for g in got], 10), [round(g["reward"], 3) for g in got]
    assert all(g["logp_mismatch"] < 0.05 for g in got[:2])  # the engine starts with the trainer's weights
    if overrides:
        assert [g["rollout_lag"] for g in got[:6]] == [0, 0, 2, 2, 2, 2]  # one batch (two updates) behind
        assert max(g["clip_fraction"] for g in got) > 0  # the second update on a rollout is clipped somewhere
        assert all(0 < g["is_ratio_mean"] for g in got)
    else:
        assert all(g["rollout_lag"] == 0 and g["logp_mismatch"] < 1e-3 for g in got)  # synced before each rollout
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["rollout"]["engine"] == "vllm" and plan["rollout"]["placement"] == "colocated"


# ---------------------------------------------------------------- a colocated engine shared by tensor-parallel ranks
class RecordingLLM:
    """Stands in for vLLM's LLM object (the library's side; ft's request building runs for real): records each
    request's prompt and seed and answers it with [first prompt token, seed]."""

    def __init__(self):
        self.submitted = []

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        asked = [(list(p["prompt_token_ids"]), sp.seed) for p, sp in zip(prompts, params)]
        self.submitted.append(asked)
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[ids[0], seed], logprobs=None)]) for ids, seed in asked
        ]


def _tensor_parallel_rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = EngineSpec(
        model="m", tokenizer="m", dtype="fp32", max_model_len=8, tensor_parallel=2, external_launcher=True
    )
    section = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=2)
    engine = VllmRollout(spec, section, stop=[0], llm=RecordingLLM())
    mine = [[10 * rank + i] for i in range(rank + 2)]  # rank 0: two prompts, rank 1: three
    got = engine.generate(mine, seed=100 * (rank + 1))
    out.put((rank, [c.ids for c in got], engine.llm.submitted))
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_sharing_a_tensor_parallel_engine_submit_the_same_requests_and_each_gets_its_own_back():
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_tensor_parallel_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (ids, sub)) for r, ids, sub in (out.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert results[0][0] == [[0, 100], [1, 101]]
    assert results[1][0] == [[10, 200], [11, 201], [12, 202]]
    # one engine: both ranks ask it the same thing, every prompt once with its own seed
    assert results[0][1] == results[1][1] == [[([0], 100), ([1], 101), ([10], 200), ([11], 201), ([12], 202)]]
