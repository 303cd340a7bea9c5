"""DeepSpeed ZeRO: the JSON written from the plan, and 2-process ZeRO-2/3 runs on CPU (gloo) against one process.

DeepSpeed's CPU accelerator compiles a shared-memory communication op the first time a job starts on a
machine (about a minute and a half here, cached afterwards), which the first test below pays.
"""

from __future__ import annotations

import json

import pytest

from finetune.errors import FtError
from tests.conftest import REPO
from tests.test_distributed import ft_train, job, losses

deepspeed = pytest.importorskip("deepspeed")

ZERO = ["--hardware", "cpu:2", "--set", "distributed.backend=deepspeed"]


def planned(hardware: str, *overrides: str):
    """The plan and config of the ZeRO-3 example, with overrides."""
    from finetune.config import load
    from finetune.workflow import compile_plan

    path = REPO / "examples/yaml/mistral-7b-zero3-2x8xa100.yaml"
    return compile_plan(path, overrides, hardware), load(path, overrides)


@pytest.mark.parametrize("sharding,offload", [("zero1", "none"), ("zero2", "optimizer"), ("zero3", "all")])
def test_deepspeed_json_follows_the_plan(sharding, offload):
    from finetune.distributed.deepspeed import config_for

    plan, config = planned("2x8xH200-141GB", f"distributed.sharding={sharding}", f"distributed.offload={offload}")
    ds = config_for(plan, config.train, config.distributed)
    assert ds["zero_optimization"]["stage"] == int(sharding[-1])
    assert ds["train_batch_size"] == plan.global_batch_size == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * plan.world_size
    assert ds["bf16"]["enabled"] == (plan.precision == "bf16") and ds["fp16"]["enabled"] == (plan.precision == "fp16")
    assert ds["gradient_clipping"] == config.train.max_grad_norm
    assert ("offload_optimizer" in ds["zero_optimization"]) == (offload != "none")
    assert ("offload_param" in ds["zero_optimization"]) == (offload == "all")
    assert ds["managed_gradient_accumulation"] is False  # ft's loop owns accumulation
    from deepspeed.runtime.config import DeepSpeedConfig

    one_rank = {**ds, "train_batch_size": ds["train_batch_size"] // plan.world_size}  # parsed without a process group: world size 1
    parsed = DeepSpeedConfig(one_rank)  # DeepSpeed itself accepts every key and derives the same accumulation
    assert parsed.gradient_accumulation_steps == plan.gradient_accumulation_steps and parsed.zero_optimization_stage == int(sharding[-1])


def test_a_users_deepspeed_file_is_used_with_auto_values_filled_from_the_plan(tmp_path):
    from finetune.distributed.deepspeed import config_for

    own = tmp_path / "ds.json"
    own.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                               "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e8}}))
    plan, config = planned("2x8xA100-40GB", f"distributed.deepspeed_config={own}")
    ds = config_for(plan, config.train, config.distributed)
    assert ds["zero_optimization"] == {"stage": 3, "stage3_max_live_parameters": 1e8}  # as written
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (plan.global_batch_size, plan.micro_batch_size, plan.gradient_accumulation_steps)
    assert ds["bf16"]["enabled"] is True
    own.write_text('{"train_batch_size": 8,\n "zero_optimization": {stage: 3}}')
    with pytest.raises(FtError, match=r"ds.json line 2: not valid JSON"):
        config_for(plan, config.train, config.distributed)


def test_zero3_matches_one_process_resumes_after_a_stop_and_consolidates(tmp_path, one_process):
    from transformers import AutoModelForCausalLM

    zero = job(tmp_path, "zero3")
    args = [*ZERO, "--set", "distributed.sharding=zero3", "--set", "output.save_steps=3"]
    stopped = ft_train(zero, *args, env={"FT_TEST_STOP_AT": "4"}, timeout=600)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    ckpt = tmp_path / "zero3" / "checkpoints" / "step-00000004"
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "rng-1.pt").exists()
    written = json.loads((tmp_path / "zero3" / "deepspeed.json").read_text())
    assert written["zero_optimization"]["stage"] == 3 and written["train_batch_size"] == 8
    resumed = ft_train(zero, *args, "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path / "zero3") == pytest.approx(losses(one_process), rel=1e-4, abs=1e-5)
    a = AutoModelForCausalLM.from_pretrained(str(one_process / "final"))
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "zero3" / "final"))  # gathered from the partitions
    assert max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters())) < 1e-4

    from finetune.consolidate import consolidate

    c1 = AutoModelForCausalLM.from_pretrained(str(consolidate(one_process, step=3, out=tmp_path / "c1")))
    c2 = AutoModelForCausalLM.from_pretrained(str(consolidate(tmp_path / "zero3", step=3)))  # from ZeRO partitions, one process
    assert max((pa - pb).abs().max().item() for pa, pb in zip(c1.parameters(), c2.parameters())) < 1e-4
    assert max((pa - pb).abs().max().item() for pa, pb in zip(c1.parameters(), a.parameters())) > 1e-3  # step 3, not the final weights


def test_lora_adapter_saved_from_zero3_reloads_and_gives_the_trained_outputs(tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = ["--set", "adapter={type: lora, r: 8, alpha: 16, dropout: 0.0}", "--set", "train.lr=0.02"]
    one = ft_train(job(tmp_path, "one"), "--hardware", "cpu", *lora)
    assert one.returncode == 0, one.stderr[-3000:]
    two = ft_train(job(tmp_path, "zero3"), *ZERO, "--set", "distributed.sharding=zero3", *lora, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    a = load_file(str(tmp_path / "one" / "final" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "zero3" / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert a[k].shape == b[k].shape and a[k].numel() > 0  # not the empty tensors of an ungathered ZeRO-3 save
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3)
    from finetune.models import model_path
    from finetune.config.schema import ModelSection

    base = AutoModelForCausalLM.from_pretrained(model_path(ModelSection(name="ft-tiny")))
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        untrained = base(ids).logits.clone()
        reloaded = PeftModel.from_pretrained(base, str(tmp_path / "zero3" / "final")).eval()
        trained = reloaded(ids).logits
    assert (trained - untrained).abs().max() > 1e-3  # the adapter changes outputs
    one_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path(ModelSection(name="ft-tiny"))), str(tmp_path / "one" / "final")).eval()
    with torch.no_grad():
        torch.testing.assert_close(trained, one_model(ids).logits, atol=1e-4, rtol=1e-3)


def test_zero2_matches_one_process(tmp_path, one_process):
    two = ft_train(job(tmp_path, "zero2"), *ZERO, "--set", "distributed.sharding=zero2", timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert losses(tmp_path / "zero2") == pytest.approx(losses(one_process), rel=1e-4, abs=1e-5)


def test_grpo_generates_and_trains_under_zero3_with_a_lora_adapter_and_kl(tmp_path):
    """Sampling needs whole parameters on every rank (ranks sample different lengths): gathered for generate()."""
    from finetune.tiny import prompt_records, write_jsonl

    prompts = write_jsonl(prompt_records(32, seed=2), tmp_path / "prompts.jsonl")
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / 'cache'}}}
method: {{name: grpo, num_generations: 4, max_new_tokens: 8, kl_coef: 0.05, rewards: [{{function: length_penalty, args: {{limit: 4}}}}]}}
adapter: {{type: lora, r: 8, alpha: 16, dropout: 0.0}}
train: {{global_batch_size: 16, micro_batch_size: 8, max_steps: 2, lr: 1.0e-3}}
output: {{dir: {tmp_path / 'run'}, log_steps: 1, save_steps: 0}}
""")
    r = ft_train(str(cfg), *ZERO, "--set", "distributed.sharding=zero3", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("reward" in row and row["kl"] >= 0 for row in rows)
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").stat().st_size > 0
