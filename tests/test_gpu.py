"""Checks that need a CUDA GPU (skipped elsewhere): bf16, QLoRA kernels, FSDP-QLoRA, host offload, NCCL.

Each runs ft train on the tiny model, on one GPU (FSDP2 and DeepSpeed as a process group of one), and
checks that the loss falls and the plan says what ran.
"""

from __future__ import annotations

import json

import pytest

from tests.test_distributed import ft_train, job, losses

pytestmark = pytest.mark.gpu


def run(tmp_path, name: str, *overrides: str, steps: int = 12):
    sets = [a for o in ("train.lr=2.0e-3", *overrides) for a in ("--set", o)]
    r = ft_train(job(tmp_path, name, steps=steps), *sets, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    plan = json.loads((tmp_path / name / "plan.json").read_text())
    trace = losses(tmp_path / name)
    assert trace[-1] < trace[0], trace
    return plan


def test_bf16_full_fine_tuning(tmp_path):
    plan = run(tmp_path, "bf16", "train.precision=bf16")
    assert (plan["precision"], plan["device"]) == ("bf16", "GPU")


def test_qlora_with_bitsandbytes_kernels(tmp_path):
    plan = run(tmp_path, "qlora", "adapter={type: qlora, r: 8, alpha: 16}", "train.precision=bf16", "train.lr=1.0e-2")
    assert (plan["adapter"], plan["quantization"]) == ("qlora", "nf4")


def test_fsdp_qlora_stores_4bit_weights_in_the_compute_dtype(tmp_path):
    plan = run(tmp_path, "fsdp-qlora", "adapter={type: qlora, r: 8, alpha: 16}", "train.precision=bf16", "train.lr=1.0e-2",
               "distributed.backend=fsdp", "distributed.sharding=full_shard")
    assert plan["backend"] == "fsdp"
    assert any(d["field"] == "quant_storage" for d in plan["decisions"])


def test_fsdp_cpu_offload(tmp_path):
    plan = run(tmp_path, "fsdp-offload", "distributed.backend=fsdp", "distributed.sharding=full_shard", "distributed.offload=all")
    assert plan["offload_target"] == "all"


def test_deepspeed_zero3_with_optimizer_and_parameter_offload(tmp_path):
    plan = run(tmp_path, "zero3-offload", "distributed.backend=deepspeed", "distributed.sharding=zero3", "distributed.offload=all", "train.precision=bf16")
    ds = json.loads((tmp_path / "zero3-offload" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu" and plan["sharding"] == "zero3"
