"""The `ft generate` and `ft eval` verbs: their options, each declared once as a dataclass field (finetune.cli makes it
a typer option: the field's default, the flags and help in its metadata) -> a job -> run it -> report."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field
from pathlib import Path

from finetune.errors import FtError


def option(default, *flags: str, help: str):
    """A command-line option: `default` (`...`: required), its flags, its help."""
    return field(default=MISSING if default is ... else default, metadata={"flags": flags, "help": help})


def argument(help: str):
    """A required positional argument."""
    return field(metadata={"flags": (), "help": help})


SOURCE_HELP = (
    "A run folder (config.yaml + final/), a model folder, an adapter folder (with --base or its recorded base), "
    "a hub id, or ft-tiny."
)
PROCESSES_HELP = (
    "Processes generating in parallel on this node (default: one per GPU, per --tensor-parallel GPUs with vLLM; "
    "1 on CPU)."
)


@dataclass(frozen=True)
class GenerateOptions:
    """`ft generate`'s options, in the order of its --help."""

    source: str = argument(SOURCE_HELP)
    prompts: str = option(
        ...,
        "--prompts",
        "-p",
        help="Prompt file (.jsonl, .json, .csv, .parquet), or a job YAML whose dataset to read (see --dataset).",
    )
    out: Path = option(
        ..., "--out", "-o", help="Output .jsonl: each input row with its id and the completion, in input order."
    )
    max_new_tokens: int = option(256, "--max-new-tokens", help="Longest completion, in tokens.")
    temperature: float = option(0.0, "--temperature", help="0: greedy (deterministic); above 0: sampling.")
    top_p: float = option(1.0, "--top-p", help="Nucleus sampling threshold.")
    top_k: int = option(0, "--top-k", help="Sample among the k likeliest tokens (0: off).")
    seed: int = option(
        0, "--seed", help="Sampling seed; each batch draws from its own seed, so results do not depend on --processes."
    )
    stop: list[str] | None = option(
        None, "--stop", help="Text that ends a completion (repeatable); not included in the output."
    )
    batch_size: int | None = option(None, "--batch-size", "-b", help="Prompts per batch (default 16; 256 with vLLM).")
    sort: bool = option(True, "--sort/--no-sort", help="Batch prompts of similar length together (less padding).")
    processes: int | None = option(None, "--processes", "-n", help=PROCESSES_HELP)
    engine: str = option("auto", "--engine", help="auto (vLLM on GPUs where installed) | transformers | vllm.")
    tensor_parallel: int = option(
        1, "--tensor-parallel", help="GPUs per model copy, for models larger than one GPU (vLLM)."
    )
    dtype: str = option("auto", "--dtype", help="auto (fp32 on CPU, bf16 on GPUs) | bf16 | fp16 | fp32.")
    template: str | None = option(
        None,
        "--template",
        help="Chat template: tokenizer, a built-in, a .jinja file, or none for raw text (default: the run's "
        "data.template, else the tokenizer's).",
    )
    system: str | None = option(None, "--system", help="System message for prompts that have none.")
    prompt_field: str | None = option(
        None,
        "--prompt-field",
        help="Column holding the prompt (default: messages, conversations, prompt, instruction, question, input or "
        "text).",
    )
    id_field: str = option(
        "id", "--id-field", help="Column with each record's id (records without one are numbered from 0)."
    )
    output_field: str = option("completion", "--output-field", help="Name of the completion's field in the output.")
    dataset: str | None = option(
        None,
        "--dataset",
        help="With a job YAML: validation, or an index into data.datasets (default: validation when it is a dataset, "
        "else 0).",
    )
    samples: int | None = option(None, "--samples", help="Only the first N prompts.")
    base: str | None = option(
        None, "--base", help="Base model of an adapter (default: the run's model.name or the adapter's recorded base)."
    )
    overwrite: bool = option(False, "--overwrite", help="Discard the output and any unfinished parts, and start over.")
    trust_remote_code: bool = option(False, "--trust-remote-code", help="Allow the model's own Python code.")
    quiet: bool = option(False, "--quiet", "-q", help="No progress bar.")


@dataclass(frozen=True)
class EvalOptions:
    """`ft eval`'s options, in the order of its --help."""

    source: str = argument(SOURCE_HELP)
    data: str | None = option(
        None,
        "--data",
        "-d",
        help="Prompt/answer file, or a job YAML (see --dataset). Default: the run's evaluation: section.",
    )
    metrics: list[str] | None = option(
        None,
        "--metric",
        "-m",
        help="exact_match | contains | regex (with --pattern) | loss (and perplexity) | a function module:function or "
        "file.py:function (repeatable; default exact_match).",
    )
    pattern: str | None = option(
        None,
        "--pattern",
        help="For --metric regex: the pattern extracting the answer (its first group if any), e.g. '####\\s*(-?\\d+)'.",
    )
    out: Path | None = option(None, "--out", "-o", help="Write the results as JSON to this file.")
    as_json: bool = option(False, "--json", help="Print the results as JSON instead of a table.")
    predictions: Path | None = option(
        None, "--predictions", help="Keep the generated answers in this .jsonl (and resume from it)."
    )
    max_new_tokens: int | None = option(
        None, "--max-new-tokens", help="Longest answer (default: the run's evaluation.max_new_tokens, else 256)."
    )
    batch_size: int | None = option(None, "--batch-size", "-b", help="Prompts per batch.")
    processes: int | None = option(None, "--processes", "-n", help=PROCESSES_HELP)
    engine: str = option("auto", "--engine", help="auto | transformers | vllm.")
    tensor_parallel: int = option(1, "--tensor-parallel", help="GPUs per model copy (vLLM).")
    dtype: str = option("auto", "--dtype", help="auto | bf16 | fp16 | fp32.")
    template: str | None = option(
        None,
        "--template",
        help="Chat template (default: the run's data.template, else the tokenizer's); none for raw text.",
    )
    reference_field: str | None = option(
        None,
        "--reference-field",
        help="Column with the reference answer (default: a final assistant message, else answer, reference, output, "
        "completion or target).",
    )
    prompt_field: str | None = option(None, "--prompt-field", help="Column holding the prompt.")
    id_field: str = option("id", "--id-field", help="Column with each record's id.")
    system: str | None = option(None, "--system", help="System message for prompts that have none.")
    dataset: str | None = option(None, "--dataset", help="With a job YAML: validation, or an index into data.datasets.")
    samples: int | None = option(None, "--samples", help="Only the first N records.")
    lm_eval: list[str] | None = option(
        None, "--lm-eval", help="lm-evaluation-harness tasks, comma-separated or repeated (needs the lm-eval extra)."
    )
    lm_eval_include: str | None = option(
        None, "--lm-eval-include", help="Folder with your own lm-eval task YAML files."
    )
    lm_eval_limit: int | None = option(None, "--lm-eval-limit", help="At most N examples per lm-eval task.")
    lm_eval_chat: bool = option(
        True,
        "--lm-eval-chat/--lm-eval-plain",
        help="Apply the chat template to lm-eval prompts (plain for base models).",
    )
    base: str | None = option(None, "--base", help="Base model of an adapter.")
    overwrite: bool = option(False, "--overwrite", help="Generate again even when --predictions holds answers.")
    trust_remote_code: bool = option(False, "--trust-remote-code", help="Allow the model's own Python code.")
    quiet: bool = option(False, "--quiet", "-q", help="No progress bar.")


def run_generate(o: GenerateOptions, role=None):
    """`ft generate`: build the job from the options, generate, print the summary. `role` (finetune.workflow.NodeRole):
    this node's place in a job across nodes."""
    from finetune.artifacts import resolve
    from finetune.infer.engines import Sampling
    from finetune.infer.generate import generate
    from finetune.infer.job import GenerateJob
    from finetune.infer.prompts import PromptSpec

    job = GenerateJob(
        source=resolve(o.source, o.base, o.trust_remote_code),
        prompts=PromptSpec(o.prompts, o.dataset, o.prompt_field, None, o.id_field, o.system, o.samples),
        out=str(o.out),
        sampling=Sampling(o.max_new_tokens, o.temperature, o.top_p, o.top_k, o.seed, tuple(o.stop or ())),
        template=o.template,
        batch_size=o.batch_size,
        sort=o.sort,
        engine=o.engine,
        tensor_parallel=o.tensor_parallel,
        dtype=o.dtype,
        output_field=o.output_field,
    )
    result = generate(job, processes=o.processes, overwrite=o.overwrite, progress=not o.quiet, role=role)
    _console().print(str(result))
    return result


def run_eval(o: EvalOptions, role=None):
    """`ft eval`: the metrics asked for (or the run's `evaluation:` section), as a table or JSON, and to --out. Across
    nodes (`role`), every node generates its share of the answers and node 0 reports."""
    from finetune.artifacts import resolve
    from finetune.infer.evaluation import LOSS, EvalJob, evaluate, from_run, print_table
    from finetune.infer.prompts import PromptSpec
    from finetune.infer.scoring import parse

    src = resolve(o.source, o.base, o.trust_remote_code)
    metrics = tuple(o.metrics or ())
    parsed = tuple(parse(m, o.pattern) for m in metrics if m != LOSS)
    if o.pattern and not any(m.kind == "regex" for m in parsed):
        raise FtError("--pattern is used by --metric regex only.\n    fix: add --metric regex, or drop --pattern")
    tasks = tuple(t.strip() for item in o.lm_eval or () for t in item.split(",") if t.strip())
    run_max = None
    if o.data is not None:
        spec = PromptSpec(o.data, o.dataset, o.prompt_field, o.reference_field, o.id_field, o.system, o.samples)
        parsed = parsed if metrics else (parse("exact_match", None),)
    elif tasks and not metrics:
        spec = None
    else:
        run_spec, run_metrics, run_max = from_run(o.source)
        samples = o.samples or run_spec.samples
        spec = PromptSpec(run_spec.path, o.dataset, o.prompt_field, o.reference_field, o.id_field, o.system, samples)
        parsed = parsed if metrics else run_metrics
    job = EvalJob(
        src,
        spec,
        parsed,
        LOSS in metrics,
        o.max_new_tokens or run_max or EvalJob.max_new_tokens,
        o.template,
        o.batch_size,
        o.engine,
        o.tensor_parallel,
        o.dtype,
        str(o.predictions) if o.predictions else None,
        tasks,
        o.lm_eval_include,
        o.lm_eval_limit,
        o.lm_eval_chat,
    )
    result = evaluate(job, processes=o.processes, overwrite=o.overwrite, progress=not o.quiet, role=role)
    if result.node_rank:
        _console().print(result.node_summary())
        return result
    text = json.dumps(result.to_json(), indent=2)
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_text(text + "\n")
    if o.as_json:
        print(text)
    else:
        print_table(result, _console(stdout=True))
        if o.out:
            _console().print(f"wrote {o.out}")
    return result


def _console(stdout: bool = False):
    from rich.console import Console

    return Console(stderr=not stdout, highlight=False, soft_wrap=True)
