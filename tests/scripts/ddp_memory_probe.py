"""Per-rank peak host memory of DDP full fine-tuning on CPU ranks: ft's, and torch's DDP as it is by default.

python -m torch.distributed.run --nproc-per-node 2 tests/scripts/ddp_memory_probe.py HARDWARE OUT CONFIG [CONFIG ...]

HARDWARE as finetune.hardware.parse reads it ("cpu:2"), or `probe` for this machine's.

For each job file in turn (in the same processes), two runs, each measured from a reset peak (/proc/self/clear_refs:
5 resets VmHWM; freed buffers of 1 MiB and more go back to the system, distributed/hostmem.py): `ft` builds the job
with train.setup and takes its train_steps (DDP with gradients as views of its buckets); `copy` loads the same model
with ft's loader and optimizer, wraps it in torch's DDP with its default gradient_as_bucket_view=False (buckets beside
the gradients) and takes one step of the same shape. Each rank writes OUT/probe-<job>-<mode>-rank<rank>.json with
`grown`: its peak resident memory minus what it held when the run started (on a GPU also `gpu_grown`, the same of
torch.cuda.max_memory_allocated), and `estimated`: the plan's per-device peak.
"""

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from finetune.config import load  # noqa: E402
from finetune.data.preprocess import prepare  # noqa: E402
from finetune.distributed.hostmem import return_freed_memory  # noqa: E402
from finetune.hardware import parse, probe  # noqa: E402
from finetune.plan import plan  # noqa: E402
from finetune.train import setup, train_step  # noqa: E402
from finetune.workflow import model_facts  # noqa: E402


def resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    found = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


def fresh_peak() -> tuple[int, int]:
    """Free what the last run left, reset the peaks (host, and the GPU's where there is one) to what is held now, and
    return those (resident bytes, GPU bytes allocated)."""
    gc.collect()
    return_freed_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if not torch.cuda.is_available():
        return resident()[0], 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return resident()[0], torch.cuda.memory_allocated()


def ft_run(config, job_plan, prepared) -> float:
    job = setup(config, job_plan, prepared)
    losses = [train_step(job)["loss"] for _ in range(job.total_steps)]
    job.runtime.barrier()
    return losses[-1]


def copy_run(config, job_plan, tokenizer) -> float:
    """torch's default DDP around ft's model and optimizer: one micro-batch of the job's shape, one step."""
    from torch.nn.parallel import DistributedDataParallel

    from finetune.models import load_model
    from finetune.optim import build_optimizer

    model = DistributedDataParallel(load_model(config.model, job_plan, tokenizer), find_unused_parameters=False)
    optimizer = build_optimizer(model, config.train, job_plan.lr)
    ids = (torch.arange(job_plan.micro_batch_size * config.data.seq_len) % len(tokenizer)).view(-1, config.data.seq_len)
    ids = ids.to(next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def main() -> None:
    hardware, out = sys.argv[1], Path(sys.argv[2])
    for i, config_path in enumerate(sys.argv[3:]):
        config = load(config_path)
        prepared = prepare(config)
        found = probe() if hardware == "probe" else parse(hardware)  # "probe": this machine's GPUs
        job_plan = plan(config, found, model_facts(config.model))
        for mode in ("ft", "copy"):
            start, start_gpu = fresh_peak()
            if mode == "ft":
                loss = ft_run(config, job_plan, prepared)
            else:
                loss = copy_run(config, job_plan, prepared.tokenizer)
            rank = torch.distributed.get_rank()
            report = {"rank": rank, "job": i, "mode": mode, "grown": resident()[1] - start, "loss": loss}
            if torch.cuda.is_available():  # what the GPU's allocator held at the peak, beyond the start
                report["gpu_grown"] = torch.cuda.max_memory_allocated() - start_gpu
            report.update(backend=job_plan.backend, estimated=job_plan.estimate.device_bytes)
            (out / f"probe-{i}-{mode}-rank{rank}.json").write_text(json.dumps(report))
            print("PROBE " + json.dumps(report), flush=True)
            torch.distributed.barrier()


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
