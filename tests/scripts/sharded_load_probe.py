"""Jobs built by train.setup on this rank, reporting peak memory and (optionally) their whole weights.

python tests/scripts/sharded_load_probe.py HARDWARE OUT CONFIG[@weights] [CONFIG ...] [--weights] [--no-step]
  [--generation=MODE] [--fresh-peak]
(under torchrun for several ranks). Each job runs in turn in the same process; each rank prints one line
`PROBE {json}` per job: its peak resident memory (VmHWM) before and after building the job and after its step
(the peak never goes down: a job after a larger one shows that one's peak, unless --fresh-peak), the loss of one
training step, and what its reference model's parameters are; the same report goes to OUT/probe-<job>-rank<rank>.json.
With --weights (every job) or @weights (that job), rank 0 writes OUT/weights-<i>.pt for job i: every parameter
gathered whole, and the logits of a fixed input, to compare with a one-process run of the same job. --fresh-peak:
before each job what the last one left is freed and the peak mark reset to the memory in use (/proc/self/clear_refs;
buffers of 1 MiB and more go back to the system, distributed/hostmem.py), so that each job's figures are its own, as
first in a fresh process.
"""

import dataclasses
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
from finetune.hardware import parse  # noqa: E402
from finetune.plan import plan  # noqa: E402
from finetune.train import autocast, setup, train_step  # noqa: E402
from finetune.workflow import model_facts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test imports this file as a module
from probe_common import peak_rss  # noqa: E402


def whole(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()


def run_job(
    config_path,
    hardware: str,
    out: Path,
    index: int = 0,
    weights: bool = False,
    step: bool = True,
    generation: str | None = None,
    fresh_peak: bool = False,
) -> dict:
    """Build one job as a rank of `hardware` would, optionally gather its weights, take one step; returns the report."""
    config = load(config_path)
    prepared = prepare(config)
    added = len(prepared.added_tokens) - len(config.data.add_special_tokens)
    job_plan = plan(config, parse(hardware), model_facts(config.model), new_tokens=added)
    if generation:
        job_plan = dataclasses.replace(job_plan, generation=generation)
    if fresh_peak:
        from finetune.distributed.hostmem import return_freed_memory

        gc.collect()
        return_freed_memory()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from the memory in use now
    before = peak_rss()
    job = setup(config, job_plan, prepared)
    loaded = peak_rss()
    if weights:
        params = {n: whole(p) for n, p in job.model.named_parameters()}  # a collective per parameter when sharded
        ids = (torch.arange(40) * 7 % len(prepared.tokenizer)).view(2, 20)
        with torch.no_grad(), autocast(job):
            logits = job.model(input_ids=ids.to(job.device)).logits.float().cpu()
        if job.runtime.rank == 0:
            torch.save({"weights": params, "logits": logits, "loading": job_plan.loading}, out / f"weights-{index}.pt")
        del params
    reference = getattr(getattr(job.method, "reference", None), "model", None)  # a frozen copy (DPO/GRPO)
    ref = next(reference.parameters()) if reference is not None else None
    metrics = train_step(job) if step else {}
    job.runtime.barrier()
    report = {
        "rank": job.runtime.rank,
        "job": index,
        "before": before,
        "loaded": loaded,
        "stepped": peak_rss(),
        "loss": metrics.get("loss"),
        "loading": job_plan.loading,
        "reference": None if ref is None else f"{type(ref).__name__} {str(ref.dtype).removeprefix('torch.')}",
    }
    del job, reference, ref
    gc.collect()
    return report


def main() -> None:
    from finetune.distributed.runtime import launched

    hardware, out = sys.argv[1], Path(sys.argv[2])
    configs = [a.split("@") for a in sys.argv[3:] if not a.startswith("--")]
    generation = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--generation=")), None)
    for i, (config_path, *options) in enumerate(configs):
        weights = "--weights" in sys.argv or "weights" in options
        step, fresh = "--no-step" not in sys.argv, "--fresh-peak" in sys.argv
        report = run_job(config_path, hardware, out, i, weights, step, generation, fresh)
        (out / f"probe-{i}-rank{report['rank']}.json").write_text(json.dumps(report))
        print("PROBE " + json.dumps(report), flush=True)
    if launched() and torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
