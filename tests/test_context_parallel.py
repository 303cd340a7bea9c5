"""Context parallelism (finetune/distributed/cp.py).

torch 2.13's ring attention serves the CUDA SDPA kernels only (the canary test below runs it on CPU with gloo and
expects its NotImplementedError), so on CPU these tests check ft's part: the split equals torch's head-tail load
balancing, the labels are shifted once over the whole sequence, and — with each rank's attention emulated exactly
(the whole sequence in the ranks' order under a causal mask of the original order, which is what the ring attention
computes) — the ranks' losses, token counts and averaged gradients equal one process's, for full fine-tuning and
LoRA, with the plain and the chunked loss. The real two-rank comparison is GPU-marked.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from finetune.data.masking import IGNORE
from finetune.distributed import cp
from finetune.errors import FtError
from finetune.methods.head import LossHead
from finetune.methods.loss import step_normaliser, trained_tokens
from tests.helpers import REPO, free_port, in_a_one_rank_group, tiny_llama

FP32 = dict(rtol=1e-5, atol=1e-6)


def batch_of(lengths: list[int], prompt: int = 7, seed: int = 0) -> dict:
    """A right-padded micro-batch as data/collate.py makes it: prompt tokens untrained, padding masked."""
    gen = torch.Generator().manual_seed(seed)
    length = max(lengths)
    ids = torch.randint(1, 256, (len(lengths), length), generator=gen)
    labels, mask = ids.clone(), torch.zeros_like(ids)
    positions = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        labels[i, :prompt], labels[i, n:] = IGNORE, IGNORE
        mask[i, :n] = 1
        positions[i, :n], positions[i, n:] = torch.arange(n), torch.arange(length - n)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "attention_mask": mask,
        "num_tokens": sum(lengths),
    }


@pytest.mark.parametrize("length,size", [(8, 2), (64, 2), (48, 3), (64, 4)])
def test_split_is_torchs_head_tail_load_balancing(length, size):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    order = cp.head_tail_order(length, size)
    assert torch.equal(order, _HeadTailLoadBalancer(length, size, "cpu")._generate_indices()[0].long())
    for rank in range(size):  # torch then shards the reordered sequence with Shard(seq_dim): torch.chunk
        assert torch.equal(cp.local_positions(length, rank, size), order.chunk(size)[rank])


@pytest.mark.parametrize("size", [2, 3])
def test_labels_are_shifted_once_over_the_whole_sequence(size):
    batch = batch_of([45, 30, 38])  # 45 tokens: padded to a multiple of 2·cp by the split
    length = -(-45 // (2 * size)) * 2 * size
    expected = torch.full((3, length), IGNORE)
    expected[:, :44] = batch["labels"][:, 1:]  # position t predicts the token at t + 1
    shards = [cp.shard(batch, rank, size) for rank in range(size)]
    for rank, local in enumerate(shards):
        mine = cp.local_positions(length, rank, size)
        assert "labels" not in local  # nothing downstream can shift them again
        assert torch.equal(local["shift_labels"], expected[:, mine])
        assert torch.equal(local["input_ids"][:, mine < 45], batch["input_ids"][:, mine[mine < 45]])
        assert torch.equal(local["position_ids"][:, mine < 45], batch["position_ids"][:, mine[mine < 45]])
        assert bool(local["attention_mask"].all())  # causal attention, no mask: what the ring attention computes
    assert sum(trained_tokens(s["shift_labels"], shifted=True) for s in shards) == trained_tokens(batch["labels"])
    assert sum(s["num_tokens"] for s in shards) == batch["num_tokens"]


@contextlib.contextmanager
def emulated_rank(model, batch: dict, rank: int, size: int):
    """Make `model` compute, for this rank's local inputs, what torch's ring attention computes: its decoder runs on
    the whole sequence in the ranks' order under a causal mask of the original order (padding not masked, as under
    context parallelism), and hands on only this rank's positions. Checks that the local inputs are that rank's."""
    rows, length = batch["input_ids"].shape
    padded = length + -length % (2 * size)
    ids = torch.nn.functional.pad(batch["input_ids"], (0, padded - length))
    positions = torch.cat([batch["position_ids"], torch.arange(length, padded).expand(rows, -1)], dim=1)
    order = cp.head_tail_order(padded, size)
    ids, positions = ids[:, order], positions[:, order]  # the whole sequence in the ranks' order
    mine = slice(rank * padded // size, (rank + 1) * padded // size)
    allowed = (order[None, :] <= order[:, None]).expand(rows, 1, padded, padded)  # causal in the original order
    decoder = model.get_base_model().model if hasattr(model, "get_base_model") else model.model

    def before(module, args, kwargs):
        assert torch.equal(kwargs["input_ids"], ids[:, mine]) and torch.equal(
            kwargs["position_ids"], positions[:, mine]
        )
        kwargs.update(input_ids=ids, position_ids=positions, attention_mask=allowed)
        return args, kwargs

    def after(module, args, output):
        output.last_hidden_state = output.last_hidden_state[:, mine]
        return output

    hooks = [decoder.register_forward_pre_hook(before, with_kwargs=True), decoder.register_forward_hook(after)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _model(adapter: str):
    model = tiny_llama("sdpa").train()
    if adapter == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)  # non-zero, so that every adapter weight has a gradient
    return model


def _grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("adapter", ["full", "lora"])
@pytest.mark.parametrize("implementation", ["plain", "chunked"])
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_losses_and_gradients_add_up_to_one_process(adapter, implementation, size):
    """What train.py does with two micro-batches on `size` context-parallel ranks (one data-parallel group): count each
    rank's tokens, normalise by their sum over ranks / world size, backward, average the gradients (DDP / FSDP2)."""
    model, head = _model(adapter), LossHead(implementation, 16)
    batches = [batch_of([60, 45], seed=1), batch_of([52, 64, 33], seed=2)]
    normaliser = step_normaliser(sum(trained_tokens(b["labels"]) for b in batches))
    one = 0.0
    for b in batches:
        loss = head.summed_nll(model, b) / normaliser
        loss.backward()
        one += float(loss.detach())
    expected = _grads(model)

    parts = [[cp.shard(b, rank, size) for b in batches] for rank in range(size)]
    tokens = sum(trained_tokens(p["shift_labels"], shifted=True) for rank in parts for p in rank)
    normaliser = step_normaliser(tokens, size)  # the loop's all-reduce over the ranks, divided by the world size
    logged, averaged = 0.0, {}
    for rank in range(size):
        for b, local in zip(batches, parts[rank]):
            with emulated_rank(model, b, rank, size):
                loss = head.summed_nll(model, local) / normaliser
            loss.backward()
            logged += float(loss) / size  # train.py: the ranks' losses summed, divided by the world size
        for name, g in _grads(model).items():
            averaged[name] = averaged.get(name, 0) + g / size
    assert logged == pytest.approx(one, rel=1e-5)
    assert set(averaged) == set(expected) and len(expected) > 0
    for name, g in expected.items():
        torch.testing.assert_close(averaged[name], g, **FP32)


def test_packed_batches_are_refused():
    from finetune.data.collate import collate

    rows = [{"input_ids": list(range(1, 9)), "labels": list(range(1, 9)), "seq_lens": [5, 3]}]
    for attn in ("sdpa", "sdpa_varlen"):
        with pytest.raises(FtError, match="data.packing: false"):
            cp.shard(collate(rows, 0, attn), 0, 2)


GOOD = dict(seq_len=4096, cp=2, attn_implementation="sdpa", packing=False, method="sft", summed_loss=True)


@pytest.mark.parametrize(
    "change,says",
    [
        (dict(device="CPU process"), "needs CUDA GPUs"),
        (dict(seq_len=4098), "divisible by 2 × 2 = 4"),
        (dict(attn_implementation="flash_attention_2"), "model.attn_implementation: sdpa"),
        (dict(attn_implementation="sdpa_varlen", packing=True), "data.packing: false"),
        (dict(method="dpo", summed_loss=False), "method.name: sft"),
        (dict(backend="deepspeed"), "distributed.backend: fsdp"),
        (dict(sliding_window=1024), "sliding-window"),
        (dict(compile=True), "train.compile: false"),
    ],
)
def test_check_names_each_constraint(change, says):
    assert (
        cp.check(**GOOD) == []
        and cp.check(**{**GOOD, "cp": 1, "device": "CPU process", "method": "dpo", "summed_loss": False}) == []
    )
    problems = cp.check(**{**GOOD, **change})
    assert problems and all(p.startswith("distributed.context_parallel: 2") for p in problems)
    assert any(says in p for p in problems), problems


def test_a_cpu_rank_refuses_before_training():
    plan = SimpleNamespace(
        context_parallel=2, seq_len=64, method="sft", device="CPU process", backend="fsdp", compile=False
    )
    with pytest.raises(FtError, match="distributed.context_parallel: 2 needs CUDA GPUs"):
        cp.for_plan(plan, tiny_llama("sdpa"), torch.device("cpu"), summed_loss=True)
    assert cp.for_plan(SimpleNamespace(context_parallel=1), None, torch.device("cpu"), False) is None


@pytest.mark.own_process  # a process group in-process: not in a pytest worker shared with later tests
def test_ring_attention_block_replaces_sdpa_with_load_balancing_on():
    """ContextParallel.attention() (entered around each micro-batch's forward and backward): SDPA is torch's ring
    attention inside, with the head-tail load balancing `shard` splits for, and gradients stay on; all restored after.
    A one-rank group in this process (the ring attention itself needs CUDA: see the canary below)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    def check():
        sdpa, balanced = F.scaled_dot_product_attention, _cp_options.enable_load_balance
        block = cp.ContextParallel(init_device_mesh("cpu", (1,)))
        with block.attention():
            assert F.scaled_dot_product_attention is not sdpa
            assert _cp_options.enable_load_balance and torch.is_grad_enabled()
        assert F.scaled_dot_product_attention is sdpa and _cp_options.enable_load_balance == balanced

    in_a_one_rank_group(check)


CANARY = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from tests.helpers import tiny_llama
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
model = tiny_llama("sdpa")
ids, pos = torch.randint(0, 256, (1, 16)), torch.arange(16)[None].clone()
try:
    with context_parallel(mesh, buffers=[ids, pos], buffer_seq_dims=[1, 1]):
        model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    print("RAN")
except NotImplementedError as e:
    print("REFUSED", str(e).splitlines()[0])
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_torch_ring_attention_does_not_run_on_cpu(tmp_path):
    """Why ft refuses context parallelism on CPUs (cp.check). When a torch release runs it here, this fails: then let
    cp.check allow CPUs and compare two gloo ranks with one process here."""
    script = tmp_path / "canary.py"
    script.write_text(CANARY)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        timeout=240,
    )
    assert r.stdout.count("REFUSED") == 2, r.stdout + r.stderr[-3000:]
    assert "_scaled_dot_product_flash_attention_for_cpu" in r.stdout


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize(
    "adapter,precision,tolerance",
    [("full", "fp32", 1e-3), ("lora", "fp32", 1e-3), ("full", "bf16", 2e-2)],  # fp32: efficient kernel; bf16: flash
)
def test_two_gpus_split_each_sequence_and_match_one_gpu(tmp_path, adapter, precision, tolerance):
    """ft train with distributed.context_parallel: 2 on two GPUs (one data-parallel group: the same rows, each rank half
    of every sequence, ft-tiny's grouped-query attention through torch's ring attention) against one GPU: the same
    per-step losses (fp32: the order of sums differs; bf16: as tests/test_gpu_multi.py allows)."""
    from tests.helpers import GPU_TIMEOUT, LORA, ft_train, job, losses, visible_gpus

    extra = LORA if adapter == "lora" else []
    sets = ["--set", f"train.precision={precision}", "--set", "model.attn_implementation=sdpa"]
    r = ft_train(job(tmp_path, "one"), *extra, *sets, env=visible_gpus(1), timeout=GPU_TIMEOUT)
    assert r.returncode == 0, r.stderr[-4000:]
    cp_sets = ["--set", "distributed.backend=fsdp", "--set", "distributed.context_parallel=2"]
    r = ft_train(job(tmp_path, "cp"), *extra, *sets, *cp_sets, env=visible_gpus(2), timeout=GPU_TIMEOUT)
    assert r.returncode == 0, r.stderr[-4000:]
    plan = json.loads((tmp_path / "cp" / "plan.json").read_text())
    assert (plan["world_size"], plan["context_parallel"]) == (2, 2), plan
    one, two = losses(tmp_path / "one"), losses(tmp_path / "cp")
    assert len(two) == len(one) == 6 and one[-1] < one[0]
    assert two == pytest.approx(one, rel=tolerance, abs=tolerance / 10)
