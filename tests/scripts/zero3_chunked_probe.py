"""Training steps of jobs under DeepSpeed ZeRO-3 (or another backend), with DeepSpeed's trace-cache messages counted.

python tests/scripts/zero3_chunked_probe.py HARDWARE OUT CONFIG[@chunk=N] ... --steps S   (under torchrun)
HARDWARE as --hardware takes it, or `probe` (the GPUs this process sees).
Each job is built as train.setup builds it, its plan's loss_chunk_tokens set to N where given, and trained for S steps.
Per job and rank, OUT/probe-JOB-rankR.json holds the steps' losses and the messages "Invalidate trace cache" DeepSpeed
printed in each step (deepspeed 0.19 runtime/zero/partitioned_param_coordinator.py:202-219, trace_prologue: printed on
rank 0 when the job's zero_optimization sets log_trace_cache_warnings): a pass whose sub-module calls differed from the
recorded ones.
"""

import contextlib
import dataclasses
import gc
import io
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

from finetune.config import load  # noqa: E402
from finetune.data.preprocess import prepare  # noqa: E402
from finetune.hardware import parse, probe  # noqa: E402
from finetune.plan import plan  # noqa: E402
from finetune.train import setup, train_step  # noqa: E402
from finetune.workflow import model_facts  # noqa: E402

INVALIDATED = "Invalidate trace cache"


def run_job(config_path: str, hardware: str, out: Path, index: int, steps: int, chunk: int | None) -> None:
    config = load(config_path)
    prepared = prepare(config)
    job_plan = plan(config, probe() if hardware == "probe" else parse(hardware), model_facts(config.model))
    if chunk is not None:
        job_plan = dataclasses.replace(job_plan, loss_implementation="chunked", loss_chunk_tokens=chunk)
    job = setup(config, job_plan, prepared)
    losses, invalidated = [], []
    for step in range(1, steps + 1):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            losses.append(train_step(job)["loss"])
        invalidated += [f"step {step}: {line}" for line in printed.getvalue().splitlines() if INVALIDATED in line]
    report = {
        "job": index,
        "rank": job.runtime.rank,
        "loss_implementation": job.method.head.implementation,
        "losses": losses,
        "invalidated": invalidated,
    }
    (out / f"probe-{index}-rank{job.runtime.rank}.json").write_text(json.dumps(report))
    job.runtime.barrier()
    if hasattr(job.engine.model, "destroy"):  # a DeepSpeed engine: its ZeRO-3 hooks hold the module
        job.engine.model.destroy()
    del job
    gc.collect()


def main() -> None:
    hardware, out = sys.argv[1], Path(sys.argv[2])
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 6
    jobs = [a for a in sys.argv[3:] if a.endswith(".yaml") or "@chunk=" in a]
    for i, spec in enumerate(jobs):
        path, _, chunk = spec.partition("@chunk=")
        run_job(path, hardware, out, i, steps, int(chunk) if chunk else None)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
