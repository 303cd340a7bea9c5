"""Checks that need a CUDA GPU (skipped elsewhere): bf16, QLoRA kernels, FSDP-QLoRA, host offload, DeepSpeed, DPO,
evaluation.

Each runs ft train on the tiny model, on one GPU (FSDP2 and DeepSpeed as a process group of one), and
checks that the loss falls and the plan says what ran. Two-GPU checks: tests/test_gpu_multi.py.
scripts/gpu-check.sh runs them all (with a per-test timeout) next to the memory check and the benchmark.
"""

from __future__ import annotations

import json

import pytest

from finetune.tiny import arithmetic_records, preference_records, write_jsonl
from tests.helpers import GPU_TIMEOUT, ft_train, job, losses, metric_rows, visible_gpus

pytestmark = pytest.mark.gpu


def run(tmp_path, name: str, *overrides: str, steps: int = 12, config: str | None = None):
    """ft train on one GPU (--hardware omitted: ft probes it) of the tiny job `name`, or of `config`; the loss must
    fall."""
    sets = [a for o in ((() if config else ("train.lr=2.0e-3",)) + overrides) for a in ("--set", o)]
    r = ft_train(config or job(tmp_path, name, steps=steps), *sets, env=visible_gpus(1), timeout=GPU_TIMEOUT)
    assert r.returncode == 0, r.stderr[-4000:]
    plan = json.loads((tmp_path / name / "plan.json").read_text())
    trace = losses(tmp_path / name)
    assert len(trace) == steps and trace[-1] < trace[0], trace
    assert plan["device"] == "GPU" and plan["world_size"] == 1, plan
    return plan


def test_bf16_full_fine_tuning(tmp_path):
    plan = run(tmp_path, "bf16", "train.precision=bf16")
    assert (plan["precision"], plan["device"]) == ("bf16", "GPU")


def test_qlora_with_bitsandbytes_kernels(tmp_path):
    plan = run(tmp_path, "qlora", "adapter={type: qlora, r: 8, alpha: 16}", "train.precision=bf16", "train.lr=1.0e-2")
    assert (plan["adapter"], plan["quantization"]) == ("qlora", "nf4")


def test_fsdp_qlora_stores_4bit_weights_in_the_compute_dtype(tmp_path):
    plan = run(
        tmp_path,
        "fsdp-qlora",
        "adapter={type: qlora, r: 8, alpha: 16}",
        "train.precision=bf16",
        "train.lr=1.0e-2",
        "distributed.backend=fsdp",
        "distributed.sharding=full_shard",
    )
    assert plan["backend"] == "fsdp"
    assert any(d["field"] == "quant_storage" for d in plan["decisions"])


def test_fsdp_cpu_offload(tmp_path):
    plan = run(
        tmp_path,
        "fsdp-offload",
        "distributed.backend=fsdp",
        "distributed.sharding=full_shard",
        "distributed.offload=all",
    )
    assert plan["offload_target"] == "all"


def test_deepspeed_zero3_with_optimizer_and_parameter_offload(tmp_path):
    pytest.importorskip("deepspeed")
    plan = run(
        tmp_path,
        "zero3-offload",
        "distributed.backend=deepspeed",
        "distributed.sharding=zero3",
        "distributed.offload=all",
        "train.precision=bf16",
    )
    ds = json.loads((tmp_path / "zero3-offload" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu" and plan["sharding"] == "zero3"


def test_deepspeed_zero1_with_bf16(tmp_path):
    """ZeRO-1 on a GPU: DeepSpeed's overlap_comm is for stages 2 and 3 (ZeRO-1 with it set crashed)."""
    pytest.importorskip("deepspeed")
    plan = run(
        tmp_path,
        "zero1",
        "distributed.backend=deepspeed",
        "distributed.sharding=zero1",
        "distributed.offload=none",
        "train.precision=bf16",
    )
    assert (plan["backend"], plan["sharding"], plan["precision"]) == ("deepspeed", "zero1", "bf16")
    ds = json.loads((tmp_path / "zero1" / "deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage"] == 1 and ds["bf16"]["enabled"] is True


def test_dpo_with_a_precomputed_reference(tmp_path):
    """Reference log-probs computed once before training and kept in a table that GPU batches index."""
    # seen 6 times in 12 steps: margins grow fast
    pairs = write_jsonl(preference_records(64, seed=3), tmp_path / "pairs.jsonl")
    config = tmp_path / "dpo.yaml"
    config.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {pairs}, format: preference}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
method: {{name: dpo, beta: 0.1, reference: precomputed}}
adapter: {{type: full}}
train: {{global_batch_size: 32, micro_batch_size: 16, max_steps: 12, lr: 1.0e-3, warmup_steps: 1, precision: bf16}}
output: {{dir: {tmp_path / "dpo"}, log_steps: 1, save_steps: 0}}
""")
    plan = run(tmp_path, "dpo", config=str(config))
    assert (plan["method"], plan["reference"], plan["precision"]) == ("dpo", "precomputed", "bf16")
    assert "reference model" not in plan["memory"]["per_device_breakdown_gib"]  # no frozen copy
    margins = [r["rewards/margin"] for r in metric_rows(tmp_path / "dpo") if "rewards/margin" in r]
    assert len(margins) == 12 and margins[-1] > margins[0], margins


def test_evaluation_after_full_fine_tuning_in_bf16(tmp_path):
    """Validation loss (autocast) and the generated-answer metric (fp32 master weights) before, during and after
    training."""
    held_out = write_jsonl(arithmetic_records(32, seed=11), tmp_path / "held-out.jsonl")
    questions = write_jsonl(arithmetic_records(16, seed=12), tmp_path / "questions.jsonl")
    plan = run(
        tmp_path,
        "eval",
        "train.precision=bf16",
        f"data.validation={{path: {held_out}, format: chat}}",
        "output.eval_steps=6",
        f"evaluation={{path: {questions}, metric: exact_match, max_new_tokens: 8, every_steps: 6}}",
    )
    assert (plan["precision"], plan["adapter"]) == ("bf16", "full")
    metrics = metric_rows(tmp_path / "eval")
    assert [r["step"] for r in metrics if "eval_loss" in r] == [6, 12], metrics
    assert [r["step"] for r in metrics if "eval_exact_match" in r] == [6], metrics
    evals = [r["eval_loss"] for r in metrics if "eval_loss" in r]
    assert all(v == v and v < 20 for v in evals), evals  # finite
    result = json.loads((tmp_path / "eval" / "result.json").read_text())
    assert result["task_before"] is not None and result["task_after"] is not None, result
    assert 0.0 <= result["task_after"] <= 1.0 and result["final_eval_loss"] == pytest.approx(evals[-1])


def test_chunked_loss_under_zero3_and_fsdp2_equals_plain_and_keeps_deepspeeds_trace(tmp_path):
    """The chunked loss on one GPU under DeepSpeed ZeRO-3 and FSDP2 (process groups of one): the plain loss's losses,
    and under ZeRO-3 no "Invalidate trace cache" message (methods/head.py chunk_count: the head called as often in
    every micro-batch, so DeepSpeed keeps its module trace and prefetches by it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import REPO, free_port

    pytest.importorskip("deepspeed")
    own = tmp_path / "ds.json"
    auto = dict.fromkeys(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"), "auto")
    own.write_text(
        json.dumps(
            {**auto, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3, "log_trace_cache_warnings": True}}
        )
    )
    jobs = []
    for name, backend in (  # FSDP2 first: a ZeRO-3 job leaves transformers' DeepSpeed switch on in the process
        ("fsdp", "{backend: fsdp, sharding: full_shard}"),
        ("z3", f"{{backend: deepspeed, sharding: zero3, deepspeed_config: {own}}}"),
    ):
        path = tmp_path / f"{name}.yaml"
        path.write_text(Path(job(tmp_path, name, steps=8)).read_text() + f"distributed: {backend}\n")
        jobs += [str(path), f"{path}@chunk=8"]
    out = tmp_path / "out"
    out.mkdir()
    launch = f"-m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 --master-port {free_port()}"
    probe = [str(REPO / "tests/scripts/zero3_chunked_probe.py"), "probe", str(out), *jobs, "--steps", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **visible_gpus(1)}
    r = subprocess.run(
        [sys.executable, *launch.split(), *probe],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=GPU_TIMEOUT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    fsdp, fsdp_chunked, z3, z3_chunked = (json.loads(p.read_text()) for p in sorted(out.glob("probe-*-rank0.json")))
    for plain, chunked in ((fsdp, fsdp_chunked), (z3, z3_chunked)):
        print(
            f"{chunked['loss_implementation']} vs {plain['loss_implementation']}: losses {chunked['losses']} vs "
            f"{plain['losses']}; trace invalidations {len(chunked['invalidated'])} vs {len(plain['invalidated'])}"
        )
        assert chunked["loss_implementation"] == "chunked" and plain["loss_implementation"] == "plain"
        assert chunked["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-3)
        assert chunked["losses"] == pytest.approx(plain["losses"], rel=2e-2)
    assert z3["invalidated"] == z3_chunked["invalidated"] == []
