"""DPO and GRPO end to end on CPU: they learn (one process and two), resume, and run under FSDP.

The tiny model is first taught the arithmetic tasks by SFT (the session fixture sft_model, tests/conftest.py), so
that DPO has preferences to sharpen and GRPO has some right answers to reinforce.
"""

from __future__ import annotations

import json

import pytest

from finetune.errors import Stopped
from finetune.tiny import preference_records, prompt_records, write_jsonl
from tests.helpers import REPO, launch_here, losses, step_hook, train_here

pytestmark = pytest.mark.slow  # every test here trains


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def dpo_job(
    tmp_path,
    name: str,
    model,
    *,
    adapter: str = "{type: lora, r: 16, alpha: 32, dropout: 0.0}",
    method: str = "{name: dpo, beta: 0.1}",
    steps: int = 20,
) -> str:
    train = write_jsonl(preference_records(960, seed=3), tmp_path / "pairs.jsonl")
    held_out = write_jsonl(preference_records(100, seed=4), tmp_path / "held-out.jsonl")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {train}, format: preference}}], seq_len: 48, cache_dir: {tmp_path / "cache"},
        validation: {{path: {held_out}, format: preference}}}}
method: {method}
adapter: {adapter}
train: {{global_batch_size: 32, micro_batch_size: 16, max_steps: {steps}, lr: 5.0e-4, warmup_steps: 3}}
output: {{dir: {tmp_path / name}, log_steps: 1, save_steps: 0}}
""")
    return str(path)


def test_dpo_raises_held_out_preference_accuracy_on_one_and_two_processes(tmp_path, sft_model):
    train_here(dpo_job(tmp_path, "one", sft_model))  # in this process (a new one spends seconds importing)
    launch_here(dpo_job(tmp_path, "two", sft_model))  # ft train --hardware cpu:2, this process the launcher
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["backend"] == "ddp"
    # the same global batch
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4, abs=1e-5)
    for name in ("one", "two"):
        final = [r for r in rows(tmp_path / name / "metrics.jsonl") if "eval_loss" in r][-1]
        # at the start the policy is the reference: every implicit reward is 0, accuracy 0 and loss ln 2 = 0.693
        # measured: 0.80 and 0.68 after 20 steps
        assert final["eval_rewards/accuracy"] > 0.65 and final["eval_loss"] < 0.69, final
        assert (tmp_path / name / "final" / "adapter_model.safetensors").exists()
    trained = [r for r in rows(tmp_path / "one" / "metrics.jsonl") if "rewards/margin" in r]
    assert trained[-1]["rewards/margin"] > trained[0]["rewards/margin"]


def test_dpo_full_fine_tuning_with_precomputed_reference_matches_a_frozen_copy(tmp_path, sft_model):
    full = "{type: full}"
    for name in ("copy", "precomputed"):
        train_here(
            dpo_job(
                tmp_path, name, sft_model, adapter=full, method=f"{{name: dpo, beta: 0.1, reference: {name}}}", steps=3
            )
        )
    assert losses(tmp_path / "precomputed") == pytest.approx(losses(tmp_path / "copy"), rel=1e-5)
    plans = [json.loads((tmp_path / n / "plan.json").read_text()) for n in ("copy", "precomputed")]
    memory = [
        p["memory"]["per_device_breakdown_gib"].get("reference model", 0)
        + p["memory"]["host_breakdown_gib"].get("reference model", 0)
        for p in plans
    ]
    assert memory[0] > 0 and memory[1] == 0  # the plan counts the copy, and only the copy


def grpo_job(tmp_path, name: str, model, steps: int = 60, extra: str = "") -> str:
    prompts = write_jsonl(prompt_records(8, seed=5), tmp_path / "prompts.jsonl")  # every prompt in every step
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: grpo, num_generations: 8, max_new_tokens: 8, rewards: [{{function: exact_match,
  args: {{column: answer}}}},
         {{function: {REPO / "examples/rewards/arithmetic.py"}:digits_right, weight: 0.5}}]}}
adapter: {{type: full}}
train: {{global_batch_size: 64, micro_batch_size: 32, max_steps: {steps}, lr: 1.0e-4, scheduler: constant}}
output: {{dir: {tmp_path / name}, log_steps: 1, save_steps: 0}}
{extra}""")
    return str(path)


def rewards(run_dir) -> list[float]:
    return [r["reward"] for r in rows(run_dir / "metrics.jsonl") if "reward" in r]


def test_grpo_raises_the_mean_reward_of_an_sft_model(tmp_path, sft_model, capfd):
    """Rollouts from the training model (transformers); on two processes with vLLM rollouts:
    tests/test_vllm_rollout.py."""
    train_here(grpo_job(tmp_path, "grpo", sft_model, steps=40))  # in this process (a new one spends seconds importing)
    said = "".join(capfd.readouterr())
    got = rewards(tmp_path / "grpo")
    assert len(got) == 40
    first, last = sum(got[:10]) / 10, sum(got[-10:]) / 10  # measured: 0.48 -> 0.75 (1 process)
    assert last > first + 0.12, got
    row = rows(tmp_path / "grpo" / "metrics.jsonl")[-1]
    assert {
        "rewards/exact_match",
        "rewards/digits_right",  # a reward's metric is named after its function
        "completion_length",
    } <= row.keys()
    closing = next(line for line in said.splitlines() if line.startswith("trained 40 steps"))
    assert f"reward {row['reward']:.4g}" in closing and "rewards/exact_match" in closing, closing


def test_grpo_resumed_after_a_stop_matches_an_uninterrupted_run(tmp_path, sft_model, monkeypatch):
    """Two updates per rollout, stopped between them: the checkpoint carries the rollout the next step reuses, and
    the rollout after it samples from the restored RNG."""
    two = ("--set", "method.num_iterations=2")
    train_here(grpo_job(tmp_path, "straight", sft_model, steps=6), *two)  # the reference: in this process
    job = grpo_job(tmp_path, "stopped", sft_model, steps=6)
    with monkeypatch.context() as hooked:  # in this process, the hook (FT_STEP_HOOK) stopping it after step 3
        for name, value in step_hook(tmp_path, stop_at=3).items():
            hooked.setenv(name, value)
        with pytest.raises(Stopped) as stopped:
            train_here(job, *two)
    assert stopped.value.exit_code == 143, str(stopped.value)
    assert train_here(job, *two, resume=True)["steps"] == 6
    # the same samples: the reused rollout kept, RNG restored
    assert rewards(tmp_path / "stopped") == pytest.approx(rewards(tmp_path / "straight"), abs=1e-6)
    assert len(set(rewards(tmp_path / "straight"))) > 1  # new rollouts after the stop, not one reused throughout
    assert losses(tmp_path / "stopped") == pytest.approx(losses(tmp_path / "straight"), abs=1e-6)


def test_grpo_with_a_lora_adapter_and_kl_under_fsdp_on_two_processes(tmp_path, sft_model):
    job = grpo_job(tmp_path, "fsdp", sft_model, steps=3, extra="distributed: {backend: fsdp, sharding: full_shard}\n")
    launch_here(  # ft train --hardware cpu:2, this process the launcher
        job,
        "--set",
        "adapter={type: lora, r: 8, alpha: 16, dropout: 0.0}",
        "--set",
        "method.kl_coef=0.05",
        "--set",
        "train.lr=2.0e-3",
    )
    got = rows(tmp_path / "fsdp" / "metrics.jsonl")
    assert len(got) == 3 and all(row["kl"] >= 0 for row in got)
    assert (tmp_path / "fsdp" / "final" / "adapter_model.safetensors").exists()
