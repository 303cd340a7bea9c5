"""Two GPUs over NCCL (skipped unless this machine has at least two CUDA GPUs).

DDP, FSDP2 full_shard and DeepSpeed ZeRO-3 on two GPUs against one GPU with twice the accumulation (the
pattern of tests/test_distributed.py on CPU): ft probes the GPUs it is shown (--hardware omitted;
CUDA_VISIBLE_DEVICES shows one or two) and the backend is forced with --set. The equivalence runs are fp32
(the planner picks bf16 on these GPUs unless told): the ranks see the same rows and differ only in the order
of sums, rel 1e-3. bf16 (autocast) rounds each matmul; over 6 steps the runs drift apart by a few 1e-3
relative, rel 2e-2. Then DPO and GRPO under FSDP (GRPO generates with sharded weights: each rank samples its
own completion lengths) and a two-rank QLoRA FSDP run, which must finish and learn. Tensor parallelism
(distributed.tensor_parallel: 2, one tp group: both GPUs on the same rows, NCCL between the split matmuls)
against one GPU with the same accumulation, full and LoRA. (Context parallelism on two GPUs:
tests/test_context_parallel.py.)
"""

from __future__ import annotations

import json

import pytest

from finetune.tiny import preference_records, prompt_records, write_jsonl
from tests.helpers import GPU_TIMEOUT, LORA, ft_train, job, losses, metric_rows, visible_gpus


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


@pytest.fixture(scope="module")
def one_gpu_lora(tmp_path_factory):
    """The tiny job with LoRA (tests/helpers.py LORA) on one GPU, bf16: its losses and its run folder."""
    tmp = tmp_path_factory.mktemp("one-gpu-lora")
    train(job(tmp, "lora"), 1, "train.precision=bf16", *LORA[1::2])
    trace = losses(tmp / "lora")
    assert len(trace) == 6 and trace[-1] < trace[0], trace
    return trace, tmp / "lora"


def _shapes(safetensors_file) -> dict:
    from safetensors import safe_open

    with safe_open(str(safetensors_file), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("adapter,precision", [("full", "fp32"), ("full", "bf16"), ("lora", "bf16")])
def test_tensor_parallel_on_two_gpus_matches_one_gpu(tmp_path, one_gpu, one_gpu_lora, adapter, precision):
    """distributed.tensor_parallel: 2 under FSDP2 on two GPUs: both ranks train on the same rows (one data-parallel
    group, so the same 2 micro-batches a step as one GPU), each holding half of every projection (LoRA's A/B split
    with them); the per-step losses equal one GPU's, and the final weights are saved whole."""
    lora = LORA[1::2] if adapter == "lora" else []
    sets = [f"train.precision={precision}", "distributed.backend=fsdp", "distributed.tensor_parallel=2", *lora]
    train(job(tmp_path, "tp"), 2, *sets)
    p = plan_of(tmp_path / "tp")
    got = (p["backend"], p["world_size"], p["tensor_parallel"], p["gradient_accumulation_steps"], p["precision"])
    assert got == ("fsdp", 2, 2, 2, precision) and p["adapter"] == adapter, p
    reference = one_gpu_lora[0] if adapter == "lora" else one_gpu[precision]
    assert losses(tmp_path / "tp") == pytest.approx(reference, **(FP32 if precision == "fp32" else BF16))
    final = tmp_path / "tp" / "final"
    if adapter == "lora":  # every adapter matrix gathered whole: the one-GPU adapter's names and shapes
        name = "adapter_model.safetensors"
        assert _shapes(final / name) == _shapes(one_gpu_lora[1] / "final" / name)
        return
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(final), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


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
