"""The `ft` command. Each verb parses its arguments, then calls one function.

Imports of torch, transformers and friends stay inside the functions that need them, so `ft --help`,
`ft validate` and `ft plan --hardware ...` start in well under a second.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from pathlib import Path

import typer

from finetune import __version__
from finetune.errors import FtError, exit_process, run_main, set_debug
from finetune.infer.commands import EvalOptions, GenerateOptions  # light: dataclasses of options, no models

app = typer.Typer(
    name="ft",
    help="ft: declarative fine-tuning. Describe a job in one YAML file; ft validates it, plans it for your hardware "
    "and explains every choice.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SetOption = typer.Option(
    None,
    "--set",
    "-s",
    metavar="KEY=VALUE",
    help="Override a key, e.g. --set train.lr=1e-4 --set data.seq_len=4096 (repeatable; `ft explain` lists keys).",
)
HardwareOption = typer.Option(
    None,
    "--hardware",
    "-H",
    metavar="DESC",
    help="Plan for hardware you describe instead of this machine: cpu, cpu:2, 1xA10G-24GB, 8xH100-80GB, "
    "2x8xA100-40GB, h100, ...",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(
        False, "--debug", help="On an unexpected error, print the full traceback (otherwise it goes to a log file)."
    ),
) -> None:
    """ft: declarative fine-tuning for large language models."""
    if debug:
        set_debug(True)


@app.command()
def validate(config: Path = typer.Argument(..., help="Job YAML file."), set_: list[str] | None = SetOption) -> None:
    """Check a job file: every problem at once, with file and line. Exit code 2 when invalid."""
    from finetune.workflow import check_job

    cfg = check_job(config, set_ or ())  # ft launch runs the same checks
    typer.echo(
        f"{config}: valid ({cfg.method.name}, model {cfg.model.name}, adapter {cfg.adapter.type}, output "
        f"{cfg.output.dir})"
    )


@app.command()
def plan(
    config: Path = typer.Argument(..., help="Job YAML file."),
    hardware: str | None = HardwareOption,
    json_: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    explain_candidates: bool = typer.Option(
        False, "--explain-candidates", help="Also list the runners-up: the best of each other setup that fits."
    ),
    set_: list[str] | None = SetOption,
) -> None:
    """Show what ft would run: every choice with its reason, memory per device and host, the launch command."""
    from finetune.report import print_plan
    from finetune.workflow import compile_plan

    print_plan(compile_plan(config, set_ or (), hardware), as_json=json_, candidates=explain_candidates)


@app.command()
def train(
    config: Path = typer.Argument(..., help="Job YAML file."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint in output.dir."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the run already in output.dir (only what ft wrote there is removed; never a run that a job is "
        "still writing).",
    ),
    allow_changes: bool = typer.Option(
        False,
        "--allow-changes",
        help="With --resume: accept a config that differs from the run's in keys that change training (recorded in "
        "the run folder).",
    ),
    hardware: str | None = HardwareOption,
    nnodes: int | None = typer.Option(None, "--nnodes", help="Nodes in the job (default: the hardware's, or SLURM's)."),
    node_rank: int | None = typer.Option(
        None, "--node-rank", help="This node's rank, 0 .. nnodes-1 (default: SLURM_NODEID or 0)."
    ),
    master_addr: str | None = typer.Option(
        None, "--master-addr", help="Address of node 0 (default: SLURM's first node)."
    ),
    master_port: int | None = typer.Option(
        None, "--master-port", help="Port on node 0 for the rendezvous (default 29500)."
    ),
    rdzv_id: str | None = typer.Option(
        None,
        "--rdzv-id",
        help="Meet the other nodes through torchrun's c10d rendezvous at --master-addr with this job id (Kubernetes: "
        "a restarted pod joins again) instead of a static rendezvous.",
    ),
    set_: list[str] | None = SetOption,
) -> None:
    """Plan, prepare the data, train (launching every rank of this node), and save the adapter or model into
    output.dir."""
    from finetune.workflow import NodeRole, run_train

    role = NodeRole.from_env(nnodes, node_rank, master_addr, master_port, rdzv_id)
    run_train(config, set_ or (), hardware, resume=resume, overwrite=overwrite, role=role, allow_changes=allow_changes)


@app.command()
def launch(
    target: str = typer.Argument(
        ..., metavar="CONFIG|generate", help="Job YAML file, or `generate` followed by -- and ft generate's arguments."
    ),
    generate_args: list[str] | None = typer.Argument(
        None, metavar="[-- GENERATE ARGS]", help="With `generate`: the arguments of ft generate, after --."
    ),
    slurm: bool = typer.Option(False, "--slurm", help="Write an sbatch script for a Slurm cluster."),
    k8s: bool = typer.Option(False, "--k8s", help="Write a Kubernetes manifest (a Kubeflow PyTorchJob)."),
    jobset: bool = typer.Option(False, "--jobset", help="With --k8s: a JobSet instead of a PyTorchJob."),
    image: str | None = typer.Option(None, "--image", help="With --k8s: the container image that has ft."),
    namespace: str | None = typer.Option(None, "--namespace", help="With --k8s: the namespace of the job."),
    volume: str | None = typer.Option(
        None, "--volume", help="With --k8s: a PersistentVolumeClaim shared by the pods, for runs and the HF cache."
    ),
    secret: str | None = typer.Option(
        None, "--secret", help="With --k8s: a Secret whose keys become environment variables (HF_TOKEN, ...)."
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="Where to write it (default: OUTPUT_DIR/job.sbatch or OUTPUT_DIR/job-k8s.yaml)."
    ),
    hardware: str | None = HardwareOption,
    time_limit: str = typer.Option("24:00:00", "--time", help="Slurm time limit."),
    partition: str | None = typer.Option(None, "--partition", help="Slurm partition."),
    set_: list[str] | None = SetOption,
) -> None:
    """Write what runs a job on a cluster, planned for --hardware: an sbatch script (--slurm) or a Kubernetes
    manifest (--k8s), after the checks of ft validate. `ft launch generate --slurm --hardware 8xH100 -- SOURCE
    --prompts P --out O` writes one for ft generate."""
    from finetune.workflow import write_generate_script, write_launch_script

    if slurm == k8s:
        raise FtError(
            "ft launch needs one scheduler: --slurm or --k8s (for one machine, ft train launches the ranks itself)"
        )
    if target == "generate":
        if not slurm:
            raise FtError("ft launch generate writes an sbatch script: add --slurm")
        args = generate_args or []
        output = _generate_params(args)["out"]
        typer.echo(f"wrote {write_generate_script(args, output, hardware, out, time_limit, partition)}")
        return
    if generate_args:
        raise FtError(f"unexpected arguments after {target}: {' '.join(generate_args)} (only `generate` takes any)")
    if slurm:
        typer.echo(f"wrote {write_launch_script(target, set_ or (), hardware, out, time_limit, partition)}")
        return
    from finetune.launch.k8s import write_manifest

    kind = "jobset" if jobset else "pytorchjob"
    written = write_manifest(
        target,
        set_ or (),
        hardware,
        out,
        image=image,
        kind=kind,
        namespace=namespace,
        volume=volume,
        secret=secret,
    )
    typer.echo(f"wrote {written}")


def _generate_params(args: list[str]) -> dict:
    """ft generate's parameters from `args`, as `ft generate ARGS` would read them; a clear error otherwise."""
    command = typer.main.get_command(app).commands["generate"]
    try:
        return command.make_context("ft generate", list(args)).params
    except Exception as e:  # click's errors (typer may carry its own copy of click: matched by what they offer)
        if callable(getattr(e, "format_message", None)):
            raise FtError(f"ft launch generate: these are not ft generate's arguments: {e.format_message()}") from None
        if type(e).__name__ == "Exit":  # --help
            raise FtError(
                "ft launch generate: give ft generate's arguments after --: -- SOURCE --prompts P --out O"
            ) from None
        raise


@app.command("rollout-server")
def rollout_server(
    config: Path = typer.Argument(..., help="Job YAML file (a GRPO job): the model, adapter rank and precision."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8420, "--port", help="Port to listen on."),
    hardware: str | None = HardwareOption,
    set_: list[str] | None = SetOption,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print vLLM's command and exit."),
) -> None:
    """Start vLLM's own server (`vllm serve`) for a GRPO job's rollouts on this machine, with the job's model and
    engine settings and the routes the trainer needs (method.rollout.url points the trainer here; method.rollout.command
    says how vLLM starts). Set FT_ROLLOUT_TOKEN to the same secret here and for the trainer to require it (vLLM's API
    key, passed through the environment)."""
    import os

    from finetune.config import load
    from finetune.rollout.factory import TOKEN_ENV, engine_spec
    from finetune.rollout.serve import server_command, server_env, shown
    from finetune.workflow import compile_plan

    job = load(config, set_ or ())
    if not hasattr(job.method, "rollout"):
        raise FtError(
            f"{config}: method.name {job.method.name!r} samples no rollouts; a rollout server serves GRPO jobs"
        )
    job_plan = compile_plan(config, set_ or (), hardware)
    spec = engine_spec(job_plan, job.model, job.adapter, job.train.seed, job.method)
    gpu = job_plan.device == "GPU"
    command = server_command(spec, host, port, job.method.rollout.command, gpu)
    typer.echo(f"ft rollout-server: listening on http://{host}:{port} once ready; vLLM runs as:\n{shown(command)}")
    if dry_run:
        return
    env = server_env(os.environ, os.environ.get(TOKEN_ENV), gpu)
    sys.stdout.flush()  # what was printed, before vLLM takes the process over
    try:
        os.execvpe(command[0], command, env)  # vLLM's server takes this process over (and its signals)
    except OSError as e:
        raise FtError(
            f"method.rollout.command: cannot start vLLM's server ({command[0]}: {e.strerror})\n    fix: install vLLM "
            "here, or set method.rollout.command to how vLLM starts where it is installed"
        ) from None


@app.command()
def consolidate(
    run: Path = typer.Argument(..., help="A run folder (output.dir of ft train)."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step (default: the newest complete one)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: RUN/consolidated/step-N)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
) -> None:
    """Write one safetensors adapter or model from a checkpoint, sharded (FSDP, DeepSpeed ZeRO) or not, in one
    process."""
    from finetune.consolidate import consolidate as run_consolidate

    typer.echo(f"wrote {run_consolidate(run, step, out, overwrite)}")


@app.command("merge-lora")
def merge_lora(
    source: Path = typer.Argument(..., help="A run folder (RUN with RUN/final) or a peft adapter folder."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the merged model (sharded safetensors + tokenizer)."),
    base: str | None = typer.Option(
        None, "--base", help="Base model (default: the run's model.name or the adapter's base)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto | bf16 | fp16 | fp32 (a QLoRA base is dequantized first)."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest safetensors shard, e.g. 5GB."),
    check_inputs: int = typer.Option(
        4, "--check-inputs", help="Random inputs on which merged and base+adapter logits are compared."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Allow the base model's own Python code."
    ),
) -> None:
    """Merge a LoRA adapter into its base model and report the largest logit difference."""
    from finetune.merge import merge_lora as merge

    report = merge(
        source,
        out,
        base=base,
        dtype=dtype,
        max_shard_size=max_shard_size,
        check_inputs=check_inputs,
        overwrite=overwrite,
        trust_remote_code=trust_remote_code,
    )
    typer.echo(str(report))


@app.command("export")
def export(
    source: Path = typer.Argument(..., help="A run folder, a model folder, or a peft adapter folder (with its base)."),
    gguf: bool = typer.Option(False, "--gguf", help="Write a GGUF file for llama.cpp and an Ollama Modelfile."),
    quant: str = typer.Option(
        "f16",
        "--quant",
        "-q",
        help="f32 | f16 | bf16, or a llama.cpp quantization: q8_0, q6_k, q5_k_m, q4_k_m, q4_0, ...",
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: RUN/export/gguf-QUANT)."),
    base: str | None = typer.Option(
        None, "--base", help="Base model of an adapter (default: the run's model.name or the adapter's base)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the files a previous export wrote there."),
    check: bool = typer.Option(
        True, "--check/--no-check", help="Load the file with llama.cpp and compare tokens and logits with transformers."
    ),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Allow the base model's own Python code."
    ),
) -> None:
    """Export a trained model (an adapter merged into its base) as GGUF for llama.cpp and Ollama."""
    if not gguf:
        raise FtError("ft export needs a format: add --gguf (a GGUF file for llama.cpp, with an Ollama Modelfile)")
    from finetune.export.gguf import export_gguf

    report = export_gguf(
        source, out, quant, base=base, overwrite=overwrite, check=check, trust_remote_code=trust_remote_code
    )
    typer.echo(str(report))


@app.command()
def push(
    run: Path = typer.Argument(..., help="A run folder (output.dir of ft train)."),
    repo: str = typer.Option(..., "--repo", help="The hub repository, ORG/NAME (created when it does not exist)."),
    adapter: bool = typer.Option(False, "--adapter", help="The LoRA adapter of final/ (the default for adapter runs)."),
    merged: bool = typer.Option(
        False, "--merged", help="The adapter merged into its base (RUN/export/merged, merged on first use, or --from)."
    ),
    gguf: bool = typer.Option(False, "--gguf", help="The .gguf files and Modelfile of `ft export RUN --gguf`."),
    source: Path | None = typer.Option(None, "--from", help="With --merged: a folder ft merge-lora wrote."),
    private: bool = typer.Option(False, "--private", help="Create the repository private (an existing one is kept)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be uploaded, ask the hub nothing."),
) -> None:
    """Upload a run's adapter, model, merged model or GGUF files to the Hugging Face Hub with ft's model card.
    Without --adapter/--merged/--gguf: the adapter of a LoRA run, the model of a full fine-tune."""
    from finetune.export.push import PushJob
    from finetune.export.push import push as run_push

    asked = [name for name, on in (("adapter", adapter), ("merged", merged), ("gguf", gguf)) if on]
    if len(asked) > 1:
        raise FtError(f"--{' and --'.join(asked)}: choose one of --adapter, --merged, --gguf")
    job = PushJob(run, repo, asked[0] if asked else None, source, private, dry_run)
    plan, url = run_push(job)
    typer.echo("\n".join(plan.lines()))
    typer.echo("dry run: nothing was uploaded" if dry_run else f"uploaded: {url}")


def _takes(options):
    """Decorator: the command's leading parameters are the fields of the dataclass `options` (finetune.infer.commands),
    each a typer option with the field's default and the flags and help of its metadata (no flags: an argument); the
    command receives them as one `options` object, its first parameter, and its own parameters follow."""
    hints = typing.get_type_hints(options)
    fields = dataclasses.fields(options)

    def declared(f):
        default = ... if f.default is dataclasses.MISSING else f.default
        if not f.metadata["flags"]:
            return typer.Argument(default, help=f.metadata["help"])
        return typer.Option(default, *f.metadata["flags"], help=f.metadata["help"])

    def decorate(command):
        keyword = inspect.Parameter.KEYWORD_ONLY
        params = [inspect.Parameter(f.name, keyword, default=declared(f), annotation=hints[f.name]) for f in fields]
        own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]
        params += [p.replace(kind=keyword) for p in own]

        def run(**values):
            return command(options(**{f.name: values.pop(f.name) for f in fields}), **values)

        run.__name__, run.__doc__, run.__signature__ = command.__name__, command.__doc__, inspect.Signature(params)
        return run

    return decorate


# ft generate / ft eval across nodes: ft train's flags, with SLURM's variables read the same way (NodeRole.from_env)
NodesOption = typer.Option(
    None,
    "--nnodes",
    help="Nodes generating together (default: SLURM's, else 1). Run the same command on every node; the output "
    "(and --predictions) must be on a filesystem every node shares.",
)
NodeRankOption = typer.Option(
    None, "--node-rank", help="This node's rank, 0 .. nnodes-1 (default: SLURM_NODEID or 0); node 0 writes the output."
)
MasterAddrOption = typer.Option(None, "--master-addr", help="Address of node 0 (default: SLURM's first node).")
MasterPortOption = typer.Option(None, "--master-port", help="Port on node 0 for the rendezvous (default 29500).")
RdzvIdOption = typer.Option(
    None, "--rdzv-id", help="Meet the other nodes through torchrun's c10d rendezvous with this id instead."
)


def _node_role(nnodes, node_rank, master_addr, master_port, rdzv_id):
    from finetune.workflow import NodeRole

    return NodeRole.from_env(nnodes, node_rank, master_addr, master_port, rdzv_id)


@app.command()
@_takes(GenerateOptions)
def generate(
    options: GenerateOptions,
    nnodes: int | None = NodesOption,
    node_rank: int | None = NodeRankOption,
    master_addr: str | None = MasterAddrOption,
    master_port: int | None = MasterPortOption,
    rdzv_id: str | None = RdzvIdOption,
) -> None:
    """Generate completions for a prompt file, data-parallel over GPUs, processes or nodes; a restart continues where
    it stopped."""
    from finetune.infer.commands import run_generate

    run_generate(options, role=_node_role(nnodes, node_rank, master_addr, master_port, rdzv_id))


@app.command("eval")
@_takes(EvalOptions)
def eval_(
    options: EvalOptions,
    nnodes: int | None = NodesOption,
    node_rank: int | None = NodeRankOption,
    master_addr: str | None = MasterAddrOption,
    master_port: int | None = MasterPortOption,
    rdzv_id: str | None = RdzvIdOption,
) -> None:
    """Measure a model: task metrics on a prompt/answer set, loss and perplexity, lm-eval-harness tasks. A table, or
    JSON."""
    from finetune.infer.commands import run_eval

    run_eval(options, role=_node_role(nnodes, node_rank, master_addr, master_port, rdzv_id))


@app.command()
def preprocess(
    config: Path = typer.Argument(..., help="Job YAML file."),
    preview: int = typer.Option(
        0, "--preview", "-p", metavar="N", help="Show N tokenized samples with the trained tokens highlighted."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild even when a matching cache entry exists."),
    set_: list[str] | None = SetOption,
) -> None:
    """Tokenize, mask, pack and cache the training data once; print a summary (and a preview)."""
    from finetune.workflow import run_preprocess

    run_preprocess(config, set_ or (), preview=preview, force=force)


@app.command()
def schema(
    output: Path = typer.Option(
        Path("schemas/ft.schema.json"), "--output", "-o", help="Where to write the JSON Schema ('-' for stdout)."
    ),
    markdown: Path | None = typer.Option(
        None, "--markdown", help="Also write the key reference as Markdown to this file."
    ),
) -> None:
    """Write the JSON Schema of job files (editors use it to complete and check YAML)."""
    from finetune.config.docs import json_schema_text, markdown_reference

    text = json_schema_text()
    if str(output) == "-":
        sys.stdout.write(text)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}", err=True)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(markdown_reference(), encoding="utf-8")
        typer.echo(f"wrote {markdown}", err=True)


@app.command()
def explain(
    key: str | None = typer.Argument(None, help="A section or dotted key, e.g. train or train.micro_batch_size."),
) -> None:
    """Describe the keys of a job file (the same text as the JSON Schema and docs/config.md)."""
    from finetune.config.docs import explain_key

    typer.echo(explain_key(key))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: user errors print a message (no traceback) and exit with their code (2); anything
    unexpected prints one message and exits 1, its traceback in a log file (`ft --debug` prints it)."""
    from finetune.quiet import no_bars_in_logs, quiet_libraries

    no_bars_in_logs()  # before any library that draws bars is imported
    quiet_libraries()  # library notices that are not the user's business (warnings and logging filters only)
    args = sys.argv[1:] if argv is None else list(argv)
    shown = " ".join(a if len(a) <= 60 else a[:40] + "..." for a in args[:4])
    run_main(lambda: _invoke(args), what=f"ft {shown}".strip())


def entry() -> None:
    """The `ft` command (and `python -m finetune`): main(), then a quick exit once everything is written."""
    exit_process(main)


def _invoke(args: list[str]) -> int:
    """Run the typer app on `args` and return its exit code; Ctrl-C comes back as KeyboardInterrupt."""
    try:
        code = app(args=args, prog_name="ft", standalone_mode=False)
    except typer.TyperException as e:  # usage errors: typer prints them as click does
        if not callable(getattr(e, "show", None)):
            raise
        e.show()
        return getattr(e, "exit_code", 2)
    except typer.Abort:
        raise KeyboardInterrupt from None
    if code == 130:  # typer's answer to Ctrl-C
        raise KeyboardInterrupt
    return code if isinstance(code, int) else 0
