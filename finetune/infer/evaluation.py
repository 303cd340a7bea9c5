"""`ft eval`: task metrics, loss and perplexity, and lm-eval-harness tasks, as JSON and as a table; and the task
metric during training (task_score).

Task metrics generate greedily through `ft generate`'s machinery (data-parallel, resumable, in input
order, kept in a predictions file), then score every sample with finetune.infer.scoring. Loss and
perplexity are measured on the reference answers of the same set (the answer's tokens and its
end-of-turn token carry the loss, as in training), in this process.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from finetune.artifacts import ModelSource
from finetune.data.tokenize import pad_id
from finetune.errors import DataError, FtError
from finetune.infer.engines import Sampling
from finetune.infer.prompts import PromptSpec
from finetune.infer.scoring import Metric, score_text

LOSS = "loss"


@dataclass(frozen=True)
class EvalJob:
    source: ModelSource
    data: PromptSpec | None
    metrics: tuple[Metric, ...] = ()
    loss: bool = False
    max_new_tokens: int = 256
    template: str | None = None
    batch_size: int | None = None
    engine: str = "auto"
    tensor_parallel: int = 1
    dtype: str = "auto"
    predictions: str | None = None  # where completions are kept (resumable); None: a temporary file
    lm_eval: tuple[str, ...] = ()
    lm_eval_include: str | None = None
    lm_eval_limit: int | None = None
    lm_eval_chat: bool = True


@dataclass
class EvalResult:
    model: str
    data: str | None = None
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    lm_eval: dict[str, dict[str, float]] = field(default_factory=dict)
    predictions: str | None = None
    generation: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, {}, [])}


def from_run(run: str) -> tuple[PromptSpec, tuple[Metric, ...], int]:
    """The run's `evaluation:` section as (data, metrics, max_new_tokens), for `ft eval RUN` without --data."""
    from finetune.artifacts import RunFolder
    from finetune.config.schema import EvaluationSection
    from finetune.infer.scoring import from_section

    folder = RunFolder(run)
    path = folder.config_path
    section = (folder.config_dict() if path.is_file() else {}).get("evaluation")
    if not section:
        raise FtError(
            f"{run}: no data to evaluate on{' (the run has no evaluation: section)' if path.is_file() else ''}.\n    "
            "fix: pass --data with a prompt-answer file"
        )
    try:
        e = EvaluationSection.model_validate(section)
    except ValueError as err:  # pydantic's ValidationError
        raise FtError(
            f"{path}: the evaluation: section is not valid ({err.__class__.__name__}: "
            f"{str(err).splitlines()[0]}).\n    fix: pass --data and --metric instead"
        ) from None
    return PromptSpec(e.path, samples=e.samples), (from_section(e),), e.max_new_tokens


def evaluate(job: EvalJob, processes: int | None = None, overwrite: bool = False, progress: bool = True) -> EvalResult:
    """Run every evaluation the job asks for; see the module docstring."""
    from finetune.infer.prompts import read_prompts
    from finetune.infer.scoring import Scorer

    if job.lm_eval:
        from finetune.infer.lmeval import check_installed

        check_installed()
    if job.data is None and (job.metrics or job.loss):
        raise FtError("task metrics and loss need --data (a prompt-answer file)")
    result = EvalResult(model=job.source.describe())
    model = tokenizer = None
    if job.data is not None:
        prompt_set = read_prompts(job.data)
        result.data, result.samples = prompt_set.where, len(prompt_set.prompts)
        scorers = [Scorer(m) for m in job.metrics]  # user functions are imported before anything is generated
        _check_references(prompt_set.prompts, job.metrics, job.loss)
        if scorers:
            _task_metrics(job, prompt_set, scorers, result, processes, overwrite, progress)
        if job.loss:
            model, tokenizer = _load(job.source, job.dtype)
            result.metrics.update(
                _loss(
                    model,
                    tokenizer,
                    job.template or prompt_set.template or job.source.template,
                    prompt_set.prompts,
                    job.batch_size or 16,
                )
            )
    if job.lm_eval:
        from finetune.infer.lmeval import run_tasks

        if model is None:
            model, tokenizer = _load(job.source, job.dtype)
        result.lm_eval = run_tasks(
            model,
            tokenizer,
            list(job.lm_eval),
            job.lm_eval_include,
            job.lm_eval_limit,
            job.batch_size or 16,
            job.lm_eval_chat,
        )
    return result


def task_score(
    model, tokenizer, jinja: str | None, section, device, batch_size: int = 32, context=None, synced: bool = False
) -> float:
    """Mean score of an `evaluation:` section's metric over its prompt/answer file, answers generated greedily (the
    task metric during training).

    Prompts are rendered with `jinja` (the job's chat template) and generated in length-sorted batches by
    the same engine and scored by the same metrics as `ft eval`. During training, `context` gives the job's
    autocast and parameter gathering (fp32 master weights must not reach half-precision-only kernels such as
    flash-attention), and `synced` keeps the ranks of a sharded model in step.
    """
    import torch

    from finetune.infer.batches import plan
    from finetune.infer.engines import TransformersEngine
    from finetune.infer.prompts import columns, encode, read_prompts
    from finetune.infer.scoring import Scorer, from_section

    scorer = Scorer(from_section(section))
    prompts = read_prompts(PromptSpec(section.path, samples=section.samples)).prompts
    ids = [encode(p, tokenizer, jinja) for p in prompts]
    engine = TransformersEngine(
        model, tokenizer, Sampling(max_new_tokens=section.max_new_tokens), device, context=context, synced=synced
    )
    was_training = model.training
    model.eval()
    texts = [""] * len(prompts)
    try:
        with torch.no_grad():
            for number, batch in enumerate(plan([len(i) for i in ids], batch_size)):
                for i, (text, _) in zip(batch, engine.generate([ids[i] for i in batch], number)):
                    texts[i] = text
    finally:
        model.train(was_training)
    scores = scorer(texts, [p.reference for p in prompts], columns(prompts), [p.origin for p in prompts])
    return sum(scores) / max(len(scores), 1)


def _check_references(prompts, metrics, loss: bool) -> None:
    if not (loss or any(m.needs_reference for m in metrics)):
        return
    missing = next((p for p in prompts if p.reference is None), None)
    if missing is not None:
        needs = (
            "loss"
            if loss and not any(m.needs_reference for m in metrics)
            else next(m.name for m in metrics if m.needs_reference)
        )
        raise FtError(
            f"{missing.origin}: {needs} needs a reference answer: the conversation does not end with an assistant "
            "message, and the record has no answer column.\n"
            "    fix: add the answers, or name their column with --reference-field"
        )


def _task_metrics(job: EvalJob, prompt_set, scorers, result: EvalResult, processes, overwrite, progress) -> None:
    from finetune.infer.generate import generate
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import columns

    prompts = prompt_set.prompts
    field_name = next(
        f for f in ("completion", "ft_completion", "ft_eval_completion") if not any(f in p.fields for p in prompts)
    )
    with tempfile.TemporaryDirectory(prefix="ft-eval-") as tmp:
        predictions = job.predictions or str(Path(tmp) / "predictions.jsonl")
        gen = generate(
            GenerateJob(
                job.source,
                job.data,
                predictions,
                Sampling(max_new_tokens=job.max_new_tokens),
                template=job.template,
                batch_size=job.batch_size,
                engine=job.engine,
                tensor_parallel=job.tensor_parallel,
                dtype=job.dtype,
                output_field=field_name,
            ),
            processes=processes,
            overwrite=overwrite,
            progress=progress,
        )
        rows = [json.loads(line) for line in Path(predictions).read_text(encoding="utf-8").splitlines()]
    completions = [r[field_name] for r in rows]
    fields = columns(prompts)
    references, origins = [p.reference for p in prompts], [p.origin for p in prompts]
    for scorer in scorers:
        scores = scorer(completions, references, fields, origins)
        result.metrics[scorer.metric.name] = sum(scores) / len(scores)
    result.predictions = job.predictions
    result.generation = {
        "engine": gen.engine,
        "processes": gen.processes,
        "generated": gen.generated,
        "max_new_tokens": job.max_new_tokens,
        "decoding": "greedy",
        "prompts_per_s": round(gen.prompts_per_s, 3),
        "tokens_per_s": round(gen.tokens_per_s, 1),
    }


def _load(source: ModelSource, dtype: str):
    import torch

    from finetune.artifacts import load_model, load_tokenizer
    from finetune.infer.engines import torch_dtype

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokenizer = load_tokenizer(source)
    return load_model(source, tokenizer, torch_dtype(dtype, device), device), tokenizer


def _loss(model, tokenizer, template: str, prompts, batch_rows: int) -> dict[str, float]:
    """Mean loss over the reference answers' tokens (as training counts them) and its exponential."""
    import contextlib

    import datasets

    from finetune.data.tokenize import Rules, fit_length, tokenize_record
    from finetune.evaluate import validation_loss
    from finetune.infer.prompts import template_for
    from finetune.methods.sft import SFT

    jinja = template_for(tokenizer, template)
    seq_len = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    rows = []
    for p in prompts:
        if jinja is None:
            if p.text is None:
                raise DataError(
                    f"{p.origin}: the prompt is a conversation, which needs a chat template.\n    fix: drop "
                    "--template none"
                )
            rules, record = (
                Rules("prompt_completion", "assistant", seq_len, "truncate", 0),
                {"prompt": p.text, "completion": p.reference},
            )
        else:
            rules, record = (
                Rules("chat", "last_assistant", seq_len, "truncate", 0),
                {"messages": [*p.messages, {"role": "assistant", "content": p.reference}]},
            )
        row, _ = fit_length(tokenize_record(record, rules, tokenizer, jinja), rules)
        if row is not None:
            rows.append({"input_ids": row["input_ids"], "labels": row["labels"]})
    pad = pad_id(tokenizer)
    loss = validation_loss(
        model,
        SFT(pad, "sdpa", batch_rows),
        datasets.Dataset.from_list(rows),
        model.device,
        contextlib.nullcontext,
        batch_rows,
    )
    return {LOSS: loss, "perplexity": math.exp(min(loss, 700.0))}


def print_table(result: EvalResult, console) -> None:
    """The results as a table: one row per metric, lm-eval tasks below."""
    from rich.table import Table

    console.print(f"{result.model}" + (f" on {result.data} ({result.samples} samples)" if result.data else ""))
    table = Table()
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result.metrics.items():
        table.add_row(name, score_text(name, value))
    for task, values in result.lm_eval.items():
        for name, value in values.items():
            table.add_row(f"{task} · {name}", f"{value:.4f}")
    console.print(table)
    g = result.generation
    if g and not g["generated"]:
        console.print(f"all completions were already in {result.predictions}")
    elif g:
        console.print(
            f"generated with {g['engine']} on {g['processes']} process{'es' if g['processes'] != 1 else ''}: "
            f"{g['prompts_per_s']:.2f} prompts/s, {g['tokens_per_s']:,.0f} tokens/s"
            + (f"; completions in {result.predictions}" if result.predictions else "")
        )
