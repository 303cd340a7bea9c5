"""The `ft` command. Each verb parses its arguments, then calls one function.

Imports of torch, transformers and friends stay inside the functions that need them, so `ft --help`,
`ft validate` and `ft plan --hardware ...` start in well under a second.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from finetune import __version__
from finetune.errors import FtError

app = typer.Typer(
    name="ft",
    help="ft: declarative fine-tuning. Describe a job in one YAML file; ft validates it, plans it for your hardware and explains every choice.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

SetOption = typer.Option(None, "--set", "-s", metavar="KEY=VALUE", help="Override a key, e.g. --set train.lr=1e-4 --set data.seq_len=4096 (repeatable; `ft explain` lists keys).")
HardwareOption = typer.Option(None, "--hardware", "-H", metavar="DESC", help="Plan for hardware you describe instead of this machine: cpu, cpu:2, 1xA10G-24GB, 8xH100-80GB, 2x8xA100-40GB, h100, ...")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit.")) -> None:
    """ft: declarative fine-tuning for large language models."""


@app.command()
def validate(config: Path = typer.Argument(..., help="Job YAML file."), set_: Optional[List[str]] = SetOption) -> None:
    """Check a job file: every problem at once, with file and line. Exit code 2 when invalid."""
    from finetune.config import load

    cfg = load(config, set_ or ())
    typer.echo(f"{config}: valid ({cfg.method.name}, model {cfg.model.name}, adapter {cfg.adapter.type}, output {cfg.output.dir})")


@app.command()
def plan(
    config: Path = typer.Argument(..., help="Job YAML file."),
    hardware: Optional[str] = HardwareOption,
    json_: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    set_: Optional[List[str]] = SetOption,
) -> None:
    """Show what ft would run: every choice with its reason, memory per device and host, the launch command."""
    from finetune.report import print_plan
    from finetune.workflow import compile_plan

    print_plan(compile_plan(config, set_ or (), hardware), as_json=json_)


@app.command()
def train(
    config: Path = typer.Argument(..., help="Job YAML file."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest complete checkpoint in output.dir."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run already in output.dir."),
    hardware: Optional[str] = HardwareOption,
    nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Nodes in the job (default: the hardware's, or SLURM's)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", help="This node's rank, 0 .. nnodes-1 (default: SLURM_NODEID or 0)."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Address of node 0 (default: SLURM's first node)."),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="Port on node 0 for the rendezvous (default 29500)."),
    set_: Optional[List[str]] = SetOption,
) -> None:
    """Plan, prepare the data, train (launching every rank of this node), and save the adapter or model into output.dir."""
    from finetune.workflow import NodeRole, run_train

    role = NodeRole.from_env(nnodes, node_rank, master_addr, master_port)
    run_train(config, set_ or (), hardware, resume=resume, overwrite=overwrite, role=role)


@app.command()
def launch(
    config: Path = typer.Argument(..., help="Job YAML file."),
    slurm: bool = typer.Option(False, "--slurm", help="Write an sbatch script for a SLURM cluster."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to write the script (default: OUTPUT_DIR/job.sbatch)."),
    hardware: Optional[str] = HardwareOption,
    time_limit: str = typer.Option("24:00:00", "--time", help="SLURM time limit."),
    partition: Optional[str] = typer.Option(None, "--partition", help="SLURM partition."),
    set_: Optional[List[str]] = SetOption,
) -> None:
    """Write what runs the job on a cluster (an sbatch script with --slurm), planned for --hardware."""
    from finetune.workflow import write_launch_script

    if not slurm:
        raise FtError("ft launch needs a scheduler: --slurm (for one machine, ft train launches the ranks itself)")
    typer.echo(f"wrote {write_launch_script(config, set_ or (), hardware, out, time_limit, partition)}")


@app.command("merge-lora")
def merge_lora(
    source: Path = typer.Argument(..., help="A run folder (RUN with RUN/final) or a peft adapter folder."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for the merged model (sharded safetensors + tokenizer)."),
    base: Optional[str] = typer.Option(None, "--base", help="Base model (default: the run's model.name or the adapter's base)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | bf16 | fp16 | fp32 (a QLoRA base is dequantized first)."),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="Largest safetensors shard, e.g. 5GB."),
    check_inputs: int = typer.Option(4, "--check-inputs", help="Random inputs on which merged and base+adapter logits are compared."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the base model's own Python code."),
) -> None:
    """Merge a LoRA adapter into its base model and report the largest logit difference."""
    from finetune.merge import merge_lora as merge

    report = merge(source, out, base=base, dtype=dtype, max_shard_size=max_shard_size, check_inputs=check_inputs,
                   overwrite=overwrite, trust_remote_code=trust_remote_code)
    typer.echo(str(report))


@app.command()
def preprocess(
    config: Path = typer.Argument(..., help="Job YAML file."),
    preview: int = typer.Option(0, "--preview", "-p", metavar="N", help="Show N tokenized samples with the trained tokens highlighted."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when a matching cache entry exists."),
    set_: Optional[List[str]] = SetOption,
) -> None:
    """Tokenize, mask, pack and cache the training data once; print a summary (and a preview)."""
    from finetune.workflow import run_preprocess

    run_preprocess(config, set_ or (), preview=preview, force=force)


@app.command()
def schema(
    output: Path = typer.Option(Path("schemas/ft.schema.json"), "--output", "-o", help="Where to write the JSON Schema ('-' for stdout)."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the key reference as Markdown to this file."),
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
def explain(key: Optional[str] = typer.Argument(None, help="A section or dotted key, e.g. train or train.micro_batch_size.")) -> None:
    """Describe the keys of a job file (the same text as the JSON Schema and docs/config.md)."""
    from finetune.config.docs import explain_key

    typer.echo(explain_key(key))


def main() -> None:
    """Console entry point: user errors print a message (no traceback) and exit with their code."""
    try:
        app()
    except FtError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
