"""QLoRA jobs' 4-bit weights and logits on a fixed batch, before and after one training step, per backend.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/qlora_logits.py \
        MODEL_DIR DATA.jsonl WORK_DIR OUT.pt [--build] --jobs single/bf16,single/fp32,fsdp/bf16,deepspeed/fp32,...

Each job (BACKEND/PRECISION) is planned by ft's planner (QLoRA nf4; backend single with world size 1, or forced to
FSDP2 full_shard or DeepSpeed ZeRO-3 over 2 ranks) and built by `finetune.train.setup`. Rank 0 writes, per job: the
4-bit weights' bytes as a forward pass sees them (gathered from the shards) and the fraction each rank holds, the
logits on a fixed batch (eval mode, no grad, the job's autocast) twice, the loss and gradient norm of one
`train_step`, and the logits after it. `single` jobs are the reference: they run on rank 0 alone, without a
wrapper, accumulating two micro-batches where each of the 2 sharded ranks takes one (the same global batch). The
jobs run one after another in the same processes, single ones first (one start-up for all).

PRECISION is train.precision (and so the 4-bit compute dtype and, sharded, the storage container); `+train-first`
skips the eval-mode forwards before the step (finetune.compat: they must not change training). `--build` first saves the
tiny Llama
(hidden 128, intermediate 256: bitsandbytes' 4-bit CPU kernels need multiples of 64). Also runs as one process
(single jobs only).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SEQ, ROWS = 24, 2  # the fixed batch


def build(model_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))


def job_yaml(model_dir: str, data: str, work: str, backend: str, precision: str) -> str:
    sharding = {"fsdp": "full_shard", "deepspeed": "zero3"}.get(backend, "auto")
    return f"""
model: {{name: {model_dir}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 48, cache_dir: {work}/cache}}
adapter: {{type: qlora, r: 8, alpha: 16, dropout: 0.0}}
quantization: {{type: nf4}}
train: {{global_batch_size: 8, micro_batch_size: 4, max_steps: 1, lr: 2.0e-2, scheduler: constant,
  precision: {precision}}}
distributed: {{backend: {backend}, sharding: {sharding}}}
output: {{dir: {work}/out-{backend}, log_steps: 1, save_steps: 0}}
"""


def logits(job, ids):
    import torch

    from finetune.train import autocast

    job.model.eval()
    with torch.no_grad(), autocast(job):
        out = job.model(input_ids=ids).logits.float().cpu()
    job.model.train()
    return out


def base_weights(job) -> tuple[dict, dict]:
    """The bytes of every 4-bit weight as a forward pass sees them, gathered whole from the shards (a collective), and
    the fraction of each that this rank holds between forward passes."""
    import bitsandbytes as bnb
    import torch

    modules = {n: m for n, m in job.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    if job.plan.backend == "deepspeed" and job.plan.sharding == "zero3":
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([m.weight for m in modules.values()], modifier_rank=None)
    elif job.plan.backend == "fsdp":
        gathered = _fsdp_unsharded(job.model)
    else:
        gathered = contextlib.nullcontext()
    held = {n.removeprefix("module."): _held_fraction(m.weight) for n, m in modules.items()}
    with gathered:
        whole = {
            n.removeprefix("module."): m.weight.detach().reshape(-1).view(torch.uint8).cpu().clone()
            for n, m in modules.items()
        }
    return whole, held


def _held_fraction(weight) -> float:
    """The part of a 4-bit weight this rank stores outside a forward pass: 1 where it is whole on every rank."""
    if hasattr(weight, "to_local"):  # FSDP2: a DTensor shard
        return weight.to_local().numel() / weight.numel()
    if hasattr(weight, "ds_tensor"):  # ZeRO-3: this rank's partition
        return weight.ds_tensor.numel() / weight.ds_numel
    return 1.0


@contextlib.contextmanager
def _fsdp_unsharded(model):
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for u in units:
        u.unshard()
    try:
        yield
    finally:
        for u in units:
            u.reshard()


def run_job(args, backend: str, name: str) -> dict:
    import torch

    from finetune.config import loads
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.train import setup, train_step
    from finetune.workflow import model_facts

    precision, _, option = name.partition("+")
    config = loads(job_yaml(args.model, args.data, args.work, backend, precision))
    job_plan = plan(config, parse("cpu:2"), model_facts(config.model))
    prepared = prepare(config)
    job = setup(config, job_plan, prepared)
    ids = torch.randint(0, len(prepared.tokenizer), (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    weights, held = base_weights(job)
    if (
        option == "train-first"
    ):  # no eval-mode forward before the step: what an eval forward may change shows as a difference
        before = again = None
    else:
        before = logits(job, ids)
        again = logits(job, ids)  # what a forward pass changed in place (layouts, quant state) shows here
    metrics = train_step(job)
    after = logits(job, ids)
    out = {
        "before": before,
        "again": again,
        "after": after,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "weights": weights,
        "held": held,
        "backend": job_plan.backend,
        "sharding": job_plan.sharding,
        "world_size": job_plan.world_size,
        "quant_storage": job_plan.quant_storage,
        "accumulation": job_plan.gradient_accumulation_steps,
    }
    rank = job.runtime.rank
    del job
    gc.collect()
    return out if rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("model", "data", "work", "out"):
        p.add_argument(name)
    p.add_argument(
        "--jobs",
        default="single/bf16,single/fp32",
        help="comma-separated BACKEND/PRECISION[+train-first], run in this order",
    )
    p.add_argument("--build", action="store_true", help="first save the tiny model to MODEL")
    args = p.parse_args()
    import torch

    if (
        int(os.environ.get("WORLD_SIZE", "1")) > 1
    ):  # under torchrun: the group ft's setup joins, for the build's barrier already
        torch.distributed.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    if args.build and rank == 0:
        build(Path(args.model))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    # a world-1 job runs on rank 0 only
    jobs = [j for j in args.jobs.split(",") if rank == 0 or not j.startswith("single/")]
    results = {job: run_job(args, *job.split("/")) for job in jobs}
    if rank == 0:
        torch.save(results, args.out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
