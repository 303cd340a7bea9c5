"""The `ft generate` and `ft eval` verbs: command-line options -> a job -> run it -> report."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import FtError


def run_generate(
    source: str,
    prompts: str,
    out: str,
    *,
    base=None,
    dataset=None,
    template=None,
    system=None,
    prompt_field=None,
    id_field="id",
    output_field="completion",
    samples=None,
    max_new_tokens=256,
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    seed=0,
    stop=(),
    batch_size=None,
    sort=True,
    processes=None,
    engine="auto",
    tensor_parallel=1,
    dtype="auto",
    overwrite=False,
    trust_remote_code=False,
    progress=True,
    role=None,
):
    """`ft generate`: build the job from the options, generate, print the summary. `role` (finetune.workflow.NodeRole):
    this node's place in a job across nodes."""
    from finetune.artifacts import resolve
    from finetune.infer.engines import Sampling
    from finetune.infer.generate import generate
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import PromptSpec

    job = GenerateJob(
        source=resolve(source, base, trust_remote_code),
        prompts=PromptSpec(prompts, dataset, prompt_field, None, id_field, system, samples),
        out=out,
        sampling=Sampling(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop)),
        template=template,
        batch_size=batch_size,
        sort=sort,
        engine=engine,
        tensor_parallel=tensor_parallel,
        dtype=dtype,
        output_field=output_field,
    )
    result = generate(job, processes=processes, overwrite=overwrite, progress=progress, role=role)
    _console().print(str(result))
    return result


def run_eval(
    source: str,
    *,
    data=None,
    dataset=None,
    metrics=(),
    pattern=None,
    reference_field=None,
    prompt_field=None,
    id_field="id",
    system=None,
    samples=None,
    template=None,
    max_new_tokens=None,
    batch_size=None,
    processes=None,
    engine="auto",
    tensor_parallel=1,
    dtype="auto",
    predictions=None,
    out=None,
    as_json=False,
    lm_eval=(),
    lm_eval_include=None,
    lm_eval_limit=None,
    lm_eval_chat=True,
    overwrite=False,
    base=None,
    trust_remote_code=False,
    progress=True,
    role=None,
):
    """`ft eval`: the metrics asked for (or the run's `evaluation:` section), as a table or JSON, and to --out. Across
    nodes (`role`), every node generates its share of the answers and node 0 reports."""
    from finetune.artifacts import resolve
    from finetune.infer.evaluation import LOSS, EvalJob, evaluate, from_run, print_table
    from finetune.infer.prompts import PromptSpec
    from finetune.infer.scoring import parse

    src = resolve(source, base, trust_remote_code)
    loss = LOSS in metrics
    parsed = tuple(parse(m, pattern) for m in metrics if m != LOSS)
    if pattern and not any(m.kind == "regex" for m in parsed):
        raise FtError("--pattern is used by --metric regex only.\n    fix: add --metric regex, or drop --pattern")
    tasks = tuple(t.strip() for item in lm_eval for t in item.split(",") if t.strip())
    run_max = None
    if data is not None:
        spec = PromptSpec(data, dataset, prompt_field, reference_field, id_field, system, samples)
        parsed = parsed if metrics else (parse("exact_match", None),)
    elif tasks and not metrics:
        spec = None
    else:
        run_spec, run_metrics, run_max = from_run(source)
        spec = PromptSpec(
            run_spec.path, dataset, prompt_field, reference_field, id_field, system, samples or run_spec.samples
        )
        parsed = parsed if metrics else run_metrics
    job = EvalJob(
        src,
        spec,
        parsed,
        loss,
        max_new_tokens or run_max or 256,
        template,
        batch_size,
        engine,
        tensor_parallel,
        dtype,
        predictions,
        tasks,
        lm_eval_include,
        lm_eval_limit,
        lm_eval_chat,
    )
    result = evaluate(job, processes=processes, overwrite=overwrite, progress=progress, role=role)
    if result.node_rank:
        _console().print(result.node_summary())
        return result
    text = json.dumps(result.to_json(), indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if as_json:
        print(text)
    else:
        print_table(result, _console(stdout=True))
        if out:
            _console().print(f"wrote {out}")
    return result


def _console(stdout: bool = False):
    from rich.console import Console

    return Console(stderr=not stdout, highlight=False, soft_wrap=True)
