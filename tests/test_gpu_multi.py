"""Two GPUs over NCCL (skipped unless this machine has at least two CUDA GPUs).

DDP, FSDP2 full_shard and DeepSpeed ZeRO-3 on two GPUs against one GPU with twice the accumulation (the
pattern of tests/test_distributed.py on CPU): ft probes the GPUs it is shown (--hardware omitted;
CUDA_VISIBLE_DEVICES shows one or two) and the backend is forced with --set. The equivalence runs are fp32
(the planner picks bf16 on these GPUs unless told): the ranks see the same rows and differ only in the order
of sums, rel 1e-3. bf16 (autocast) rounds each matmul; over 6 steps the runs drift apart by a few 1e-3
relative, rel 2e-2. Then DPO and GRPO under FSDP (GRPO generates with sharded weights: each rank samples its
own completion lengths) and a two-rank QLoRA FSDP run, which must finish and learn.
"""

from __future__ import annotations

import json

import pytest

from finetune.tiny import preference_records, prompt_records, write_jsonl
from tests.helpers import GPU_TIMEOUT, ft_train, job, losses, metric_rows, visible_gpus


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs")]
FP32 = dict(rel=1e-3, abs=1e-4)
BF16 = dict(rel=2e-2, abs=2e-3)


def train(config: str, gpus: int, *overrides: str):
    r = ft_train(config, *[a for o in overrides for a in ("--set", o)], env=visible_gpus(gpus), timeout=GPU_TIMEOUT)
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def plan_of(run_dir) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    """The tiny job on one GPU, fp32 and bf16: 6 steps of 2 micro-batches of 4."""
    tmp = tmp_path_factory.mktemp("one-gpu")
    out = {}
    for precision in ("fp32", "bf16"):
        train(job(tmp, precision), 1, f"train.precision={precision}")
        p = plan_of(tmp / precision)
        assert (p["backend"], p["world_size"], p["gradient_accumulation_steps"], p["device"]) == (
            "single",
            1,
            2,
            "GPU",
        ), p
        out[precision] = losses(tmp / precision)
        assert len(out[precision]) == 6 and out[precision][-1] < out[precision][0]
    return out


@pytest.mark.parametrize(
    "backend,sharding,precision",
    [
        ("ddp", None, "fp32"),
        ("fsdp", "full_shard", "fp32"),
        ("deepspeed", "zero3", "fp32"),
        ("ddp", None, "bf16"),
    ],
)
def test_two_gpus_match_one_gpu_with_twice_the_accumulation(tmp_path, one_gpu, backend, sharding, precision):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    sets = [
        f"train.precision={precision}",
        f"distributed.backend={backend}",
        *([f"distributed.sharding={sharding}"] if sharding else []),
    ]
    r = train(job(tmp_path, "two"), 2, *sets)
    assert "--nproc-per-node=2" in r.stderr
    p = plan_of(tmp_path / "two")
    assert (p["backend"], p["world_size"], p["gradient_accumulation_steps"], p["precision"]) == (
        backend,
        2,
        1,
        precision,
    ), p
    if sharding:
        assert p["sharding"] == sharding
    assert losses(tmp_path / "two") == pytest.approx(one_gpu[precision], **(FP32 if precision == "fp32" else BF16))


def test_dpo_under_fsdp_on_two_gpus(tmp_path):
    pairs = write_jsonl(preference_records(64, seed=3), tmp_path / "pairs.jsonl")
    config = tmp_path / "dpo.yaml"
    config.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {pairs}, format: preference}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
method: {{name: dpo, beta: 0.1}}
adapter: {{type: lora, r: 16, alpha: 32, dropout: 0.0}}
train: {{global_batch_size: 32, micro_batch_size: 8, max_steps: 8, lr: 5.0e-3, warmup_steps: 1, precision: bf16}}
distributed: {{backend: fsdp, sharding: full_shard}}
output: {{dir: {tmp_path / "dpo"}, log_steps: 1, save_steps: 0}}
""")
    train(str(config), 2)
    p = plan_of(tmp_path / "dpo")
    assert (p["method"], p["backend"], p["world_size"], p["reference"]) == ("dpo", "fsdp", 2, "adapter"), p
    margins = [r["rewards/margin"] for r in metric_rows(tmp_path / "dpo") if "rewards/margin" in r]
    assert len(margins) == 8 and margins[-1] > margins[0], margins
    assert (tmp_path / "dpo" / "final" / "adapter_model.safetensors").stat().st_size > 0


def test_grpo_generates_with_sharded_weights_under_fsdp_on_two_gpus(tmp_path):
    prompts = write_jsonl(prompt_records(32, seed=2), tmp_path / "prompts.jsonl")
    config = tmp_path / "grpo.yaml"
    config.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: grpo, num_generations: 4, max_new_tokens: 12, kl_coef: 0.05,
  rewards: [{{function: length_penalty, args: {{limit: 4}}}}]}}
adapter: {{type: lora, r: 8, alpha: 16, dropout: 0.0}}
train: {{global_batch_size: 16, micro_batch_size: 8, max_steps: 3, lr: 1.0e-3, precision: bf16}}
distributed: {{backend: fsdp, sharding: full_shard}}
output: {{dir: {tmp_path / "grpo"}, log_steps: 1, save_steps: 0}}
""")
    train(str(config), 2)
    p = plan_of(tmp_path / "grpo")
    assert (p["method"], p["backend"], p["world_size"]) == ("grpo", "fsdp", 2) and p["generation"] != "local", p
    got = [r for r in metric_rows(tmp_path / "grpo") if "reward" in r]
    assert len(got) == 3 and all(r["kl"] >= 0 for r in got), got
    assert (tmp_path / "grpo" / "final" / "adapter_model.safetensors").stat().st_size > 0


def test_qlora_under_fsdp_on_two_gpus(tmp_path):
    train(
        job(tmp_path, "qlora", steps=12),
        2,
        "adapter={type: qlora, r: 8, alpha: 16}",
        "train.precision=bf16",
        "train.lr=1.0e-2",
        "distributed.backend=fsdp",
        "distributed.sharding=full_shard",
    )
    p = plan_of(tmp_path / "qlora")
    assert (p["adapter"], p["quantization"], p["backend"], p["world_size"], p["quant_storage"]) == (
        "qlora",
        "nf4",
        "fsdp",
        2,
        "bf16",
    ), p
    trace = losses(tmp_path / "qlora")
    assert len(trace) == 12 and trace[-1] < trace[0], trace
