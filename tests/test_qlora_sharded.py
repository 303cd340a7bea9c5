"""QLoRA under sharding: FSDP2 and ZeRO-3 4-bit models compute what the single-process QLoRA model computes.

FSDP2 shards bitsandbytes' `Params4bit` weights (stored in the compute dtype's container) into plain DTensors and
bitsandbytes restores their quant state in forward; ZeRO-3 partitions them and gathers them around each module.
A falling loss does not show that the gathered 4-bit weights are right (bitsandbytes issue #1945 reports wrong
`Linear4bit` outputs after `fully_shard`), so these tests compare the sharded models' weights and logits with the
single-process model's, before and after one training step (2 ranks × 1 micro-batch against 1 rank × 2).

One torchrun (2 gloo ranks) runs every job of tests/scripts/qlora_logits.py: the one-process references first (on
rank 0), then FSDP2 and ZeRO-3 at fp32 and bf16. fp32 must agree to 1e-4. bf16 cannot agree bit for bit: the sharded
backends hold the non-quantized parameters (norms, embeddings, head, which peft keeps in fp32 for k-bit training)
and the residual stream in bf16 where the single process keeps fp32 under autocast; the two backends agree with
each other exactly, and with the single process to about one bf16 step of the logits.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "tests" / "scripts" / "qlora_logits.py"
BACKENDS = ("fsdp", "deepspeed")
JOBS = [
    "single/bf16",
    "single/fp32",
    "single/bf16+train-first",
    "fsdp/fp32",
    "fsdp/bf16",
    "deepspeed/fp32",
    "deepspeed/bf16",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("bitsandbytes")
    import torch

    from finetune.tiny import arithmetic_records, write_jsonl

    tmp = tmp_path_factory.mktemp("qlora_sharded")
    data = write_jsonl(arithmetic_records(64, seed=7), tmp / "data.jsonl")
    out = tmp / "results.pt"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            str(tmp / "model"),
            str(data),
            str(tmp),
            str(out),
            "--build",
            "--jobs",
            ",".join(JOBS),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_4bit_weights_are_split_over_ranks_and_gather_bit_for_bit(results, backend):
    import torch

    for precision in ("fp32", "bf16"):
        ref, got = results[f"single/{precision}"], results[f"{backend}/{precision}"]
        assert (got["backend"], got["world_size"], got["quant_storage"]) == (backend, 2, precision)
        assert got["sharding"] == {"fsdp": "full_shard", "deepspeed": "zero3"}[backend]
        # 7 linear layers × 2 blocks
        assert ref["weights"].keys() == got["weights"].keys() and len(ref["weights"]) == 14
        for name, data in ref["weights"].items():
            assert torch.equal(got["weights"][name], data), name
            assert got["held"][name] <= 0.5 + 1e-3, name  # sharded, not replicated
    as_bf16 = sum(int(torch.isnan(w.view(torch.bfloat16)).sum()) for w in ref["weights"].values())
    # packed nibbles that read as bf16 NaNs (what a NaN-canonicalizing copy would corrupt) came through
    assert as_bf16 > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_qlora_matches_one_process_in_fp32(results, backend):
    ref, got = results["single/fp32"], results[f"{backend}/fp32"]
    assert (ref["accumulation"], got["accumulation"]) == (2, 1)  # the same global batch
    scale = ref["before"].abs().max().item()
    assert _max_diff(got["before"], ref["before"]) <= 1e-4 * scale
    assert _max_diff(got["again"], ref["before"]) <= 1e-4 * scale
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    moved = _max_diff(ref["after"], ref["before"])
    assert moved > 0.1 * scale  # the step changes the outputs, so the comparison after it means something
    assert _max_diff(got["after"], ref["after"]) <= 1e-4 * scale


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_qlora_matches_one_process_in_bf16(results, backend):
    ref, got = results["single/bf16"], results[f"{backend}/bf16"]
    scale = ref["before"].abs().max().item()
    assert _max_diff(got["before"], ref["before"]) <= 2e-2 * scale  # measured: 2 bf16 steps of a logit (0.9%)
    assert _max_diff(got["again"], ref["before"]) <= 2e-2 * scale
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-3)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)
    # After the step only loosely: Adam's first update is lr·sign(gradient), so the gradient elements near zero
    # whose sign bf16 rounding flips move by 2·lr (measured: 5% of the step's change; a lost gradient path: 87%).
    moved = _max_diff(ref["after"], ref["before"])
    assert _max_diff(got["after"], ref["after"]) <= 0.25 * moved
    other = results[f"{({'fsdp', 'deepspeed'} - {backend}).pop()}/bf16"]
    # FSDP2 computes the head's logits a chunk of vocabulary rows at a time (distributed/vocab.py), DeepSpeed in one
    # GEMM: the same bf16 rounding bound as against one process, not bit equality
    assert _max_diff(got["after"], other["after"]) <= 0.25 * moved


@pytest.mark.slow
def test_an_eval_forward_leaves_later_qlora_forwards_and_training_unchanged(results):
    """Validation, generation and DPO references run eval-mode forwards before and between training steps. On CPUs
    with AVX512-BF16, bitsandbytes 0.50 would repack the 4-bit weights in the first one (finetune/compat.py): training
    would then lose its gradient path through the base (measured: half the gradient norm) and a sharded model's next
    forward would be wrong (measured: 1.4 × the logits' scale)."""
    ref, fresh, fsdp = results["single/bf16"], results["single/bf16+train-first"], results["fsdp/bf16"]
    assert ref["grad_norm"] == pytest.approx(fresh["grad_norm"], rel=1e-6)
    assert ref["loss"] == pytest.approx(fresh["loss"], rel=1e-6)
    assert _max_diff(ref["after"], fresh["after"]) == 0
    assert _max_diff(fsdp["again"], fsdp["before"]) == 0
