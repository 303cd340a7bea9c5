"""One process of `ft generate`: its share of the planned batches, appended to its part file.

    python -m finetune.infer.worker OUT.parts ATTEMPT      (started by torchrun; rank from RANK/WORLD_SIZE)
    python -m finetune.infer.worker OUT.parts ATTEMPT|- --nodes N --gpus G      (a job across N nodes)

Processes do not talk to each other while they generate: the plan fixes who does which batch, and the
launcher merges. Across nodes (finetune.infer.nodes) they share, through torchrun's store, the attempt
node 0 planned ("-": read it there) and a barrier at the end; G is this node's GPU count.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from finetune.errors import FtError

BATCH_HOOK = "FT_BATCH_HOOK"  # test/debug hook: path/to/file.py:function, called as hook(rank, batches_done)
_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def run(
    parts: Path,
    attempt: int,
    rank: int,
    world: int,
    local_rank: int = 0,
    on_rows=None,
    hooks=(),
    gpus: int | None = None,
    local_world: int | None = None,
) -> None:
    """Generate this rank's batches of attempt `attempt`; `on_rows(rows, tokens)` after each batch, then each of
    `hooks` (tests and debugging; see batch_hooks) as hook(rank, batches_done). `gpus`: this node's GPU count (default:
    the one the launcher counted on node 0); `local_world`: the processes of this node (default `world`)."""
    from finetune.infer.batches import deal
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import encode
    from finetune.infer.store import PartWriter, write_stats

    job = GenerateJob.from_json(json.loads((parts / "job.json").read_text()))
    plan = json.loads((parts / f"plan-{attempt}.json").read_text())
    mine = deal(plan["todo"], rank, world)
    gpus = plan["gpus"] if gpus is None else gpus
    if job.engine == "vllm" and world > 1:
        _own_devices(local_rank, local_world or world, job.tensor_parallel, gpus)
    prompts, tokenizer, jinja, processor = _inputs(job, plan["keys"])
    engine = _engine(job, tokenizer, local_rank, plan["longest"], gpus, processor, prompts) if mine else None
    skip, writer = set(plan["skip"]), PartWriter(parts, attempt, rank)
    start, rows, tokens = time.time(), 0, 0
    try:
        for done, b in enumerate(mine, 1):
            batch = plan["batches"][b]
            outputs = engine.generate(
                [encode(prompts[i], tokenizer, jinja, processor) for i in batch],
                b,
                images=[prompts[i].images for i in batch] if processor is not None else None,
            )
            items = [
                (prompts[i].id, n, _row(job, prompts[i], text)) for i, (text, n) in zip(batch, outputs) if i not in skip
            ]
            writer.write(items)
            rows, tokens = rows + len(items), tokens + sum(n for _, n, _ in items)
            if on_rows is not None:
                on_rows(len(items), sum(n for _, n, _ in items))
            for hook in hooks:
                hook(rank, done)
    finally:
        writer.close()
    write_stats(parts, attempt, rank, rows, tokens, start, time.time())


def _inputs(job, keys: list[str]):
    from finetune.artifacts import load_tokenizer
    from finetune.infer.prompts import load_processor, read_prompts, template_for
    from finetune.infer.store import id_key

    prompts = read_prompts(job.prompts).prompts
    if [id_key(p.id) for p in prompts] != keys:
        raise FtError(
            f"{job.prompts.path} changed after the job was planned.\n    fix: run the command again (it plans "
            "anew and keeps the rows already written)"
        )
    tokenizer = load_tokenizer(job.source)
    return prompts, tokenizer, template_for(tokenizer, job.template), load_processor(job.source, prompts)


def _row(job, prompt, text: str) -> str:
    from finetune.infer.store import row_text

    return row_text(prompt.fields, job.prompts.id_field, prompt.id, job.output_field, text)


def _engine(job, tokenizer, local_rank: int, longest: int, gpus: int, processor=None, prompts=()):
    import torch

    from finetune.infer import engines

    if job.engine == "vllm":
        return engines.VllmEngine(
            job.source,
            tokenizer,
            job.sampling,
            job.tensor_parallel,
            job.dtype,
            longest,
            gpus > 0,
            images_per_prompt=max((len(p.images) for p in prompts), default=0),
        )
    from transformers.utils import logging

    from finetune.artifacts import load_model

    logging.disable_progress_bar()
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    model = load_model(job.source, tokenizer, engines.torch_dtype(job.dtype, device), device)
    return engines.TransformersEngine(model, tokenizer, job.sampling, device, processor=processor)


def _own_devices(local_rank: int, local_world: int, tensor_parallel: int, gpus: int) -> None:
    """Give this process's vLLM engine its own devices, and hide torchrun's variables from vLLM (each engine is a
    model of its own, not a rank of one). GPUs: its group of `tensor_parallel` GPUs of this node, set before CUDA
    starts here (`gpus`, counted by this node's launcher, stands in for asking CUDA). CPU: its share of the cores
    for vLLM's thread binding, where the user has not set one (vLLM binds where its engine runs in a process of its
    own, VLLM_ENABLE_V1_MULTIPROCESSING=1, and would bind every engine to the same cores)."""
    if gpus:
        # local_rank counts this node's processes only (torchrun's LOCAL_RANK), so each group lies on this node's GPUs
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
            ids[local_rank * tensor_parallel : (local_rank + 1) * tensor_parallel]
        )
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, core_share(local_rank, local_world))))
    for name in _LAUNCHER_VARS + tuple(k for k in os.environ if k.startswith("TORCHELASTIC_")):
        os.environ.pop(name, None)


def core_share(local_rank: int, local_world: int) -> list[int]:
    """The cores of process `local_rank` of `local_world` on this machine: an equal share of those this process may
    use, one each (shared round) where there are more processes than cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(1, len(cores) // local_world)
    first = (local_rank * share) % len(cores)
    return cores[first : first + share]


def batch_hooks() -> tuple:
    """The hook that FT_BATCH_HOOK names (path/to/file.py:function or package.module:function), for tests and
    debugging: each process calls it after every batch it has written as hook(rank, batches_done); it may, for
    instance, kill the process to test resuming. Read once, when the process starts; none when the variable is
    unset."""
    spec = os.environ.get(BATCH_HOOK)
    if not spec:
        return ()
    from finetune.userfn import load_function

    return (load_function(spec, BATCH_HOOK),)


def _arguments(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m finetune.infer.worker")
    parser.add_argument("parts", type=Path)
    parser.add_argument("attempt", help='the attempt to run, or "-": the one node 0 planned')
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    planned = None if args.attempt == "-" else int(args.attempt)
    try:
        group = None
        if args.nodes > 1:
            from finetune.infer.nodes import NodeGroup

            group = NodeGroup(rank, world)  # before run(): vLLM's set-up hides MASTER_ADDR/MASTER_PORT
            planned = group.attempt(planned)
        run(args.parts, planned, rank, world, local, hooks=batch_hooks(), gpus=args.gpus, local_world=local_world)
        if group is not None:
            group.finish()
    except FtError as e:
        sys.stderr.write(f"error (process {rank}): {e}\n")
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
