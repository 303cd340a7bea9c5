"""ORPO, SimPO, KTO and reward models on two processes under the sharded backends equal one process, step by step.

Each method trains 3 steps from the SFT'd tiny model (the session fixture sft_model) on one process, then on two
processes under a sharded backend (which is also the 2-process check): ORPO with LoRA under FSDP2, SimPO full
fine-tuning under DeepSpeed ZeRO-3, KTO full fine-tuning (a frozen reference copy) under FSDP2. The same global batch
(16 rows, 4 per micro-batch) gives the same per-step losses. A reward model's new score head starts from the same
seeded values however the model is built (whole, on the meta device for FSDP2, partitioned for ZeRO-3).
"""

from __future__ import annotations

import json

import pytest

from finetune.tiny import preference_records, write_jsonl
from tests.helpers import ZERO3_XFAIL, launch_here, losses, metric_rows, train_here

pytestmark = pytest.mark.slow  # every test here trains, on one and two processes

LORA = "{type: lora, r: 8, alpha: 16, dropout: 0.0}"


def feedback_rows() -> list[dict]:
    """64 unpaired rows, 3 desirable to 1 undesirable, each desirable completion the same sentence and each undesirable
    one another: raising the desirable sentence raises it after every prompt, so KTO's KL baseline (each prompt with
    another row's completion) rises far above 0 by step 2 and the runs compare it averaged over ranks. (With arithmetic
    answers the baseline's sign after a step varied with the CPU's rounding, and clamped at 0 it compared nothing.)"""
    prompts = [pair["prompt"] for pair in preference_records(64, seed=3)]
    good, bad = "I can answer that.", "No."
    return [
        {
            "prompt": prompt,
            "completion": [{"role": "assistant", "content": bad if i % 4 == 3 else good}],
            "label": i % 4 != 3,
        }
        for i, prompt in enumerate(prompts)
    ]


def preference_job(
    tmp_path, name: str, model, method: str, adapter: str, fmt: str = "preference", lr: str = "5.0e-4"
) -> str:
    """3 steps of 16 rows (4 per micro-batch) on 64 tiny rows; no evaluation, no checkpoints."""
    rows = feedback_rows() if fmt == "unpaired" else preference_records(64, seed=3)
    data = write_jsonl(rows, tmp_path / f"{fmt}.jsonl")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: {fmt}}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
method: {method}
adapter: {adapter}
train: {{global_batch_size: 16, micro_batch_size: 4, max_steps: 3, lr: {lr}, warmup_steps: 0}}
output: {{dir: {tmp_path / name}, log_steps: 1, save_steps: 0}}
""")
    return str(path)


def one_and_two(tmp_path, model, method: str, adapter: str, backend: list[str], **job) -> dict:
    """Trains the job on one process and on two under `backend` (--set overrides); returns the two plans."""
    train_here(preference_job(tmp_path, "one", model, method, adapter, **job))  # the reference: in this process
    launch_here(preference_job(tmp_path, "two", model, method, adapter, **job), *backend)  # ft train --hardware cpu:2
    got, want = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert len(set(want)) > 1  # it trains: the losses change step by step
    return {n: json.loads((tmp_path / n / "plan.json").read_text()) for n in ("one", "two")}


def test_orpo_with_lora_under_fsdp_on_two_processes_equals_one_process(tmp_path, sft_model):
    plans = one_and_two(tmp_path, sft_model, "{name: orpo, lambda: 0.5}", LORA, ["--set", "distributed.backend=fsdp"])
    assert (plans["two"]["backend"], plans["two"]["world_size"], plans["two"]["reference"]) == ("fsdp", 2, "none")
    assert (tmp_path / "two" / "final" / "adapter_model.safetensors").exists()


@pytest.mark.xfail(**ZERO3_XFAIL)
def test_simpo_full_fine_tuning_under_zero3_on_two_processes_equals_one_process(tmp_path, sft_model):
    pytest.importorskip("deepspeed")
    zero3 = ["--set", "distributed.backend=deepspeed", "--set", "distributed.sharding=zero3"]
    plans = one_and_two(tmp_path, sft_model, "{name: simpo, beta: 2.0, gamma: 1.0}", "{type: full}", zero3)
    assert (plans["two"]["backend"], plans["two"]["sharding"], plans["two"]["world_size"]) == ("deepspeed", "zero3", 2)
    assert (tmp_path / "two" / "final" / "model.safetensors").exists()


def test_kto_full_fine_tuning_with_a_reference_copy_under_fsdp_on_two_processes_equals_one_process(tmp_path, sft_model):
    fsdp = ["--set", "distributed.backend=fsdp"]
    method = "{name: kto, beta: 0.5}"
    plans = one_and_two(tmp_path, sft_model, method, "{type: full}", fsdp, fmt="unpaired")
    assert (plans["two"]["backend"], plans["two"]["world_size"], plans["two"]["reference"]) == ("fsdp", 2, "copy")
    kl = {n: [row["kl"] for row in metric_rows(tmp_path / n) if "kl" in row] for n in ("one", "two")}
    assert kl["two"] == pytest.approx(kl["one"], rel=1e-4, abs=1e-5) and max(kl["one"]) > 1  # measured 0, 15.3, 14.6
    assert (tmp_path / "two" / "final" / "model.safetensors").exists()


@pytest.mark.xfail(**ZERO3_XFAIL)
def test_a_reward_model_under_fsdp_and_zero3_on_two_processes_equals_one_process(tmp_path, sft_model):
    """Full fine-tuning: FSDP2 builds the classifier on the meta device and ZeRO-3 partitioned, each filling the score
    head (absent from the causal LM's checkpoint) with the values one process gives it."""
    pytest.importorskip("deepspeed")
    train_here(preference_job(tmp_path, "one", sft_model, "{name: reward}", "{type: full}"))
    want = losses(tmp_path / "one")
    assert len(want) == 3 and len(set(want)) > 1
    for name, backend in (
        ("fsdp", ["distributed.backend=fsdp"]),
        ("zero3", ["distributed.backend=deepspeed", "distributed.sharding=zero3"]),
    ):
        job = preference_job(tmp_path, name, sft_model, "{name: reward}", "{type: full}")
        sets = [arg for b in backend for arg in ("--set", b)]
        launch_here(job, *sets)  # ft train --hardware cpu:2
        plan = json.loads((tmp_path / name / "plan.json").read_text())
        assert (plan["head"], plan["world_size"], plan["loading"]) == (
            "score",
            2,
            "meta" if name == "fsdp" else "partitioned",
        )
        assert losses(tmp_path / name) == pytest.approx(want, rel=1e-4, abs=1e-5), name
        config = json.loads((tmp_path / name / "final" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForSequenceClassification"]
