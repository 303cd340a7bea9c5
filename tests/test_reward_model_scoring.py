"""GRPO with a trained reward model as a reward (`rewards: [{model: FOLDER}]`): its scores, batch-size invariance, the
config and plan-time checks, the plan's memory, and an end-to-end run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune.config import loads
from finetune.config.methods import GRPOMethod, RewardSpec
from finetune.errors import FtError
from finetune.methods.grpo import GRPO
from finetune.methods.reward_model import model_name
from finetune.methods.rewards import load_rewards
from finetune.plan.reward_models import classifier_config
from tests.helpers import train_here

PROMPTS = [[{"role": "user", "content": "What is 2+3?"}], [{"role": "user", "content": "Name a colour, please."}]]
TEXTS = ["5", "It is 5.", "", "blue and a much longer answer " * 3]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny reward model as ft's reward method saves one: the tiny Llama as a sequence classifier with one output,
    pad_token_id set, saved with its tokenizer (safetensors)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForSequenceClassification

    from finetune.tiny import ensure_model

    base = ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = AutoConfig.from_pretrained(base, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # scores that differ between completions
    folder = tmp_path_factory.mktemp("reward") / "rm" / "final"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _rows(n: int) -> dict:
    return {
        "extra": ['{"answer": "5"}'] * n,
        "prompt": [json.dumps(PROMPTS[i % 2]) for i in range(n)],
    }


def test_scores_equal_a_direct_forward_on_the_same_tokenization(reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.data.masking import tokenize_continuation

    (reward,) = load_rewards([RewardSpec(model=str(reward_model), batch_size=3)])
    prompts = [PROMPTS[i % 2] for i in range(len(TEXTS))]
    got = reward(TEXTS, prompts, {}, [f"row {i}" for i in range(len(TEXTS))])
    model = AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    tok = AutoTokenizer.from_pretrained(reward_model)
    want = []
    for prompt, text in zip(prompts, TEXTS):
        ids, _ = tokenize_continuation(prompt, [{"role": "assistant", "content": text}], tok, tok.chat_template)
        with torch.no_grad():
            want.append(model(input_ids=torch.tensor([ids])).logits[0, 0].item())
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) == len(got)  # the test model tells the completions apart
    assert reward.name == "rm" and not any(p.requires_grad for p in reward.model.parameters())
    assert not reward.model.training and reward.model.dtype == torch.float32  # the plan's precision on CPU


def test_the_same_completions_score_the_same_whatever_the_batch_size(reward_model):
    texts = TEXTS * 3
    prompts = [PROMPTS[i % 2] for i in range(len(texts))]
    origins = [f"row {i}" for i in range(len(texts))]
    one = load_rewards([RewardSpec(model=str(reward_model), batch_size=1)])[0](texts, prompts, {}, origins)
    many = load_rewards([RewardSpec(model=str(reward_model), batch_size=16)])[0](texts, prompts, {}, origins)
    assert many == pytest.approx(one, abs=1e-5)


def test_long_sequences_keep_their_last_tokens(reward_model):
    """Cut to max_tokens from the left: the end, where the score is read, stays."""
    (reward,) = load_rewards([RewardSpec(model=str(reward_model))], max_tokens=16)
    long = "word " * 50
    seq = reward.encode(PROMPTS[0], long, "row 0")
    assert len(seq) == 16
    (whole,) = load_rewards([RewardSpec(model=str(reward_model))], max_tokens=4096)
    assert seq == whole.encode(PROMPTS[0], long, "row 0")[-16:]


def test_a_reward_model_is_summed_with_a_function_reward_by_weight(reward_model):
    specs = [RewardSpec(model=str(reward_model), weight=0.5), RewardSpec(function="exact_match", weight=2.0)]
    section = GRPOMethod(name="grpo", num_generations=2, rewards=specs)
    rewards = load_rewards(section.rewards)
    method = GRPO(section, _Tok(), 4, None, None, rewards)
    texts = ["5", "six", "5", "4"]
    total, metrics = method.score(texts, _rows(2), [0, 1])
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    scores = torch.tensor(rewards[0](texts, prompts, {}, ["r"] * 4))
    exact = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert total.tolist() == pytest.approx((0.5 * scores + 2.0 * exact).tolist(), abs=1e-6)
    assert metrics["rewards/rm"] == pytest.approx(scores.mean().item(), abs=1e-6)
    assert metrics["rewards/exact_match"] == 0.5


class _Tok:
    pad_token_id, eos_token_id = 0, 1


@pytest.mark.parametrize(
    "spec, needle",
    [
        (dict(function="exact_match", model="runs/rm/final"), "both `function` and `model`"),
        (dict(), "neither `function` nor `model`"),
        (dict(model="runs/rm/final", args={"column": "answer"}), "method.rewards[0].args"),
        (dict(function="exact_match", batch_size=4), "method.rewards[0].batch_size"),
        (dict(function="exact_match", template="chatml"), "method.rewards[0].template"),
    ],
)
def test_config_errors_name_the_reward_key(spec, needle):
    section = GRPOMethod(name="grpo", rewards=[RewardSpec(**spec)])
    text = "\n".join(p.render() for p in section.problems())
    assert needle in text and "fix:" in text, text


def test_a_job_file_with_both_kinds_is_refused_with_the_key():
    text = """
model: {name: ft-tiny}
data: {datasets: [{path: p.jsonl, format: prompt_only}], seq_len: 64}
method: {name: grpo, num_generations: 2, rewards: [{function: exact_match, model: runs/rm/final}]}
output: {dir: run}
"""
    with pytest.raises(FtError, match=r"method\.rewards\[0\]"):
        loads(text, environ={})


def test_unfit_models_are_refused_before_any_weight_loads(reward_model, tmp_path):
    from finetune.tiny import ensure_model

    def error(model: str) -> str:
        with pytest.raises(FtError) as e:
            classifier_config(RewardSpec(model=model), 1)
        return str(e.value)

    assert "method.rewards[1].model" in error(str(tmp_path / "missing" / "rm"))
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in error(str(tmp_path / "empty"))
    causal = error(str(ensure_model()))
    assert "not a sequence classifier" in causal and "2 outputs" in causal and "num_labels: 1" in causal
    unpadded = tmp_path / "unpadded"
    unpadded.mkdir()
    config = json.loads((reward_model / "config.json").read_text())
    config.pop("pad_token_id")
    (unpadded / "config.json").write_text(json.dumps(config))
    assert "pad_token_id" in error(str(unpadded))


def test_a_model_without_safetensors_fails_to_load_clearly(reward_model, tmp_path):
    folder = tmp_path / "nosafetensors"
    shutil.copytree(reward_model, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FtError, match=r"method\.rewards\[0\]\.model: cannot load .* from safetensors"):
        load_rewards([RewardSpec(model=str(folder))])


def test_reward_model_names():
    assert model_name("runs/rm/final") == "rm"
    assert model_name("runs/rm/checkpoints/step-100/") == "rm"
    assert model_name("org/rm-7b") == "rm-7b"


def _grpo_plan(rewards: str):
    from finetune.catalog import lookup
    from finetune.hardware import parse
    from finetune.plan import plan

    text = f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: p.jsonl, format: prompt_only}}], seq_len: 64}}
method: {{name: grpo, num_generations: 4, engine: transformers, rewards: [{rewards}]}}
adapter: {{type: full}}
train: {{global_batch_size: 16, micro_batch_size: 4}}
output: {{dir: run}}
"""
    return plan(loads(text, environ={}), parse("1xH100-80GB"), lookup("ft-tiny"))


def test_the_plan_counts_the_reward_model_in_each_gpus_memory(reward_model):
    from finetune.catalog import from_hf_config
    from finetune.plan.memory import REWARD_MODEL, SCORING, reward_model_params

    with_function = _grpo_plan("{function: exact_match}")
    with_model = _grpo_plan(f"{{model: {reward_model}}}")
    facts = from_hf_config(json.loads((reward_model / "config.json").read_text()), "rm")
    weights = 2 * reward_model_params(facts)  # bf16 on the GPU
    assert reward_model_params(facts) == _saved_params(reward_model)  # counted from config.json, as saved
    assert with_model.estimate.device[REWARD_MODEL] == weights
    assert REWARD_MODEL not in with_function.estimate.device
    grown = with_model.estimate.device_bytes - with_function.estimate.device_bytes
    assert grown == pytest.approx(weights, rel=0.1)  # plus the allocator's reserve on it
    assert "reward model" in with_model.to_json()["memory"]["per_device_breakdown_gib"]
    big_batches = _grpo_plan(f"{{model: {reward_model}, batch_size: 4096}}")  # scoring outgrows the training phase
    assert big_batches.estimate.device[SCORING] > with_model.estimate.device["activations"]
    assert "activations" not in big_batches.estimate.device


def _saved_params(folder) -> int:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())


def test_a_plan_with_an_unfit_reward_model_stops_with_the_key():
    from finetune.tiny import ensure_model

    with pytest.raises(FtError, match=r"method\.rewards\[0\]\.model: .* not a sequence classifier"):
        _grpo_plan(f"{{model: {ensure_model()}}}")


@pytest.mark.slow
def test_grpo_trains_with_a_reward_model_as_its_reward(tmp_path, sft_model, reward_model):
    from finetune.tiny import prompt_records, write_jsonl

    prompts = write_jsonl(prompt_records(8, seed=5), tmp_path / "prompts.jsonl")
    job = tmp_path / "grpo.yaml"
    job.write_text(f"""
model: {{name: {sft_model}}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: grpo, num_generations: 4, max_new_tokens: 8, rewards: [{{model: {reward_model}, batch_size: 8}},
  {{function: exact_match, args: {{column: answer}}}}]}}
adapter: {{type: full}}
train: {{global_batch_size: 16, micro_batch_size: 8, max_steps: 2, lr: 1.0e-4, scheduler: constant}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 0}}
""")
    train_here(job)  # in this process (a new one spends seconds importing)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    got = [row for row in map(json.loads, lines) if "reward" in row]
    assert len(got) == 2
    assert all("rewards/rm" in row and "rewards/exact_match" in row for row in got), got
