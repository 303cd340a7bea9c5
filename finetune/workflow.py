"""Glue between the CLI and the pure parts: load the config, get the hardware and the model facts, plan."""

from __future__ import annotations

import os
from typing import Iterable

from finetune.errors import FtError, HardwareError
from finetune.plan.plan import Plan


def hardware_for(description: str | None):
    """The hardware to plan for: described (`--hardware`) or probed from this machine."""
    from finetune.hardware import HardwareSpecError, parse, probe

    if description is None:
        return probe()
    try:
        return parse(description)
    except HardwareSpecError as e:
        raise HardwareError(f"--hardware: {e}") from None


def model_facts(model) -> object:
    """Architecture facts for the config's model section (local folder, catalog, or hub)."""
    from finetune.catalog import ModelNotFound, resolve

    try:
        return resolve(model.name, revision=model.revision, trust_remote_code=model.trust_remote_code)
    except ModelNotFound as e:
        raise FtError(str(e)) from None


def compile_plan(config_path: str | os.PathLike, overrides: Iterable[str] = (), hardware: str | None = None) -> Plan:
    """Config file -> Plan, raising FtError subclasses with user-facing messages."""
    from finetune.config import load
    from finetune.plan import plan

    config = load(config_path, overrides)
    hw = hardware_for(hardware)
    return plan(config, hw, model_facts(config.model), str(config_path))


def run_preprocess(config_path: str | os.PathLike, overrides: Iterable[str] = (), preview: int = 0, force: bool = False):
    """`ft preprocess`: prepare (or reuse) the cached data with a progress bar, then summarise it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.data.preview import print_preview, print_summary

    config = load(config_path, overrides)
    console = Console(stderr=True, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        prepared = prepare(config, force=force, progress=progress)
    out = Console(highlight=False)
    out.print(f"{'built' if prepared.built else 'reused cached'} data: {prepared.path}")
    print_summary(prepared.summary, out)
    if preview:
        print_preview(prepared.train, prepared.tokenizer, preview, out)
    return prepared
