"""Jobs built by train.setup, one after another in the same process(es), each reporting its peak memory and
(optionally) its whole weights: for DeepSpeed ZeRO-3 on several ranks, or the same job in one process.

python tests/scripts/zero3_load_probe.py HARDWARE OUT CONFIG[@weights][@step] ... [--replica]
(under torchrun for several ranks). Per job and rank, OUT/probe-JOB-rankR.json holds: the peak resident memory
(VmHWM, bytes) before and after building the job (model created, then wrapped), whether every parameter is
partitioned, the elements this rank holds, the reference model's kind, and with --step one training step's loss.
--replica builds ZeRO-3 jobs as ft did before partitioned loading (every rank loads the whole model, then
deepspeed.initialize partitions it). @weights: rank 0 writes OUT/weights-JOB.pt with every parameter whole, and the
names that the final save (`full_state_dict(trainable_only=True)`) gathered; @step: one training step.
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
from finetune.train import setup, train_step  # noqa: E402
from finetune.workflow import model_facts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when a test imports this file as a module
from probe_common import peak_rss  # noqa: E402


def whole_weights(model) -> dict:
    """Every parameter whole (under ZeRO-3 a collective per parameter)."""
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None, enabled=hasattr(p, "ds_id")):
            out[name] = p.detach().cpu().clone()
    return out


def gathers_of_final_save(engine) -> list[str]:
    """The names of the tensors full_state_dict(trainable_only=True) gathers (GatheredParameters, recorded)."""
    import deepspeed

    names = {id(t): n for n, t in engine.inner.state_dict(keep_vars=True).items()}
    seen, original = [], deepspeed.zero.GatheredParameters

    class Recording(original):
        def __init__(self, params, *args, **kwargs):
            seen.extend(names.get(id(p), "?") for p in params)
            super().__init__(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = Recording
    try:
        engine.full_state_dict(trainable_only=True)
    finally:
        deepspeed.zero.GatheredParameters = original
    return seen


def reference_kind(method) -> str | None:
    ref = getattr(getattr(method, "reference", None), "model", None)
    if ref is None:
        return None
    return f"{type(ref).__name__} partitioned={all(hasattr(p, 'ds_id') for p in ref.parameters())}"


def run_job(config_path: str, hardware: str, out: Path, index: int, replica=False, weights=False, step=False) -> dict:
    """Build one job as train.setup does, report on it, free it."""
    config = load(config_path)
    prepared = prepare(config)
    added = len(prepared.added_tokens) - len(config.data.add_special_tokens)
    job_plan = plan(config, parse(hardware), model_facts(config.model), new_tokens=added)
    if replica:
        job_plan = dataclasses.replace(job_plan, loading="replica")
    before = peak_rss()
    job = setup(config, job_plan, prepared)
    params = list(job.inner.parameters())
    report = {
        "job": index,
        "rank": job.runtime.rank,
        "before": before,
        "loaded": peak_rss(),
        "loading": job_plan.loading,
        "partitioned": all(hasattr(p, "ds_id") for p in params),
        "reference": reference_kind(job.method),
        "held": sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params),
        "total": sum(getattr(p, "ds_numel", p.numel()) for p in params),
    }
    if weights:
        whole = whole_weights(job.inner)
        saved = gathers_of_final_save(job.engine) if job_plan.backend == "deepspeed" else None
        if job.runtime.is_main:
            trainable = [n for n, p in job.inner.named_parameters() if p.requires_grad]
            torch.save(
                {"weights": whole, "final_save_gathers": saved, "trainable": trainable, "loading": job_plan.loading},
                out / f"weights-{index}.pt",
            )
    if step:
        report["loss"] = train_step(job)["loss"]
    (out / f"probe-{index}-rank{job.runtime.rank}.json").write_text(json.dumps(report))
    job.runtime.barrier()
    if hasattr(job.engine.model, "destroy"):  # a DeepSpeed engine: its ZeRO-3 hooks hold the module
        job.engine.model.destroy()
    del job, params
    gc.collect()
    return report


def main() -> None:
    hardware, out = sys.argv[1], Path(sys.argv[2])
    jobs = [a.split("@") for a in sys.argv[3:] if not a.startswith("--")]
    for i, (config_path, *options) in enumerate(jobs):
        run_job(
            config_path,
            hardware,
            out,
            i,
            replica="--replica" in sys.argv,
            weights="weights" in options,
            step="step" in options,
        )
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    from finetune.errors import exit_process

    # ends as ft's ranks do, after a barrier and without the interpreter's teardown, where gloo's threads can abort a
    # finished rank
    exit_process(main)
