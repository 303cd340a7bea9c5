"""Printing a Plan for people or programs (JSON).

On a terminal the decisions, memory and runners-up are rich tables that wrap to its width. Piped (`ft plan job.yaml >
plan.txt`), nothing wraps: a table is plain columns, one row a line (the reasons last, as long as they are), and every
summary is one line, so that the text reads, greps and diffs whole.
"""

from __future__ import annotations

import json
import shlex
import sys

from finetune.plan.memory import LOADING, GiB
from finetune.plan.plan import Plan

DAY = 86400
LONG_RUN_SECONDS = 7 * DAY  # a run estimated longer than this is warned about
LONG_CPU_RUN_SECONDS = DAY  # on CPU-only hardware, where a GPU would take a small share of it


def assumptions() -> str:
    from finetune.plan.cost import MFU, PCIE_BPS
    from finetune.plan.memory import FRAGMENTATION
    from finetune.plan.search import GPU_HEADROOM

    return (
        f"every row is seq_len tokens (packed or padded); torch's caching allocator reserves about "
        f"{FRAGMENTATION:.0%} beyond what tensors use, and the CUDA context takes about 1 GiB outside it; "
        f"{GPU_HEADROOM:.0%} of each GPU is left free; step times assume {MFU:.0%} of the accelerator's peak, "
        f"{PCIE_BPS / 1e9:.0f} GB/s to host RAM and the link speeds in plan/comm.py: for ranking setups, not promises"
    )


def print_plan(plan: Plan, as_json: bool = False, candidates: bool = False, console=None) -> None:
    """`ft plan`: the plan as text (to `console`, default stdout), or as JSON."""
    if as_json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
        return
    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    if not console.is_terminal:
        console.soft_wrap = True  # piped: each line whole
    e = plan.estimate
    _say(console, f"{plan.model} · {plan.method} · on {plan.hardware}", "bold")
    _say(
        console,
        f"{e.total_params:,} parameters, {e.trainable_params:,} trained "
        f"({100 * e.trainable_params / e.total_params:.2f}%)",
    )
    rows = [(d.field, _fmt(d.value), "you" if d.source == "config" else "ft", d.reason) for d in plan.decisions]
    _table(console, "Decisions (by: ft chose it, or you set it in the config)", ("choice", "value", "by", "why"), rows)
    _print_memory(console, plan)
    for line in (*_step_lines(plan), *_run_lines(plan)):
        _say(console, line, "bold" if line.startswith("Warning") else None)
    if plan.rollout:
        _say(console, rollout_line(plan))
    if plan.stop_seconds:
        _say(
            console,
            f"Stopping: {plan.checkpoint_bytes / GiB:.1f} GiB per node per checkpoint; {plan.stop_seconds} s from a "
            "stop signal to a complete checkpoint (the warning ft launch asks a scheduler for)",
        )
    if plan.device == "GPU":
        _say(console, f"Assumptions: {assumptions()}", "dim")
    if candidates:
        _print_candidates(console, plan)
    launch = " ".join(shlex.quote(a) if not a.startswith("--node-rank=$") and "$" not in a else a for a in plan.launch)
    if plan.rollout and plan.rollout.placement == "ray":
        launch = (
            f"ft train starts each rank as a Ray actor running {launch} (RANK, WORLD_SIZE, MASTER_ADDR set per rank)"
        )
    console.print("Launch: " + launch, soft_wrap=True, markup=False)


def _say(console, text: str, style: str | None = None) -> None:
    """One summary line: plain text (no rich markup in it), wrapped only on a terminal."""
    console.print(text, style=style, markup=False)


def _table(console, title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[int, ...] = ()):
    """A titled table: rich's on a terminal; piped, plain columns padded to their widest cell, one row a line."""
    if console.is_terminal:
        from rich.table import Table
        from rich.text import Text

        table = Table(title=title, title_justify="left")
        for i, col in enumerate(columns):
            table.add_column(col, justify="right" if i in right else "left", overflow="fold")
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))
        console.print(table)
        return
    widths = [max(len(cell) for cell in col) for col in zip(columns, *rows)]
    _say(console, title)
    for row in (columns, *rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        _say(console, ("  " + "  ".join(cells)).rstrip())


def _print_memory(console, plan: Plan) -> None:
    """The per-device breakdown at the training peak, what the planner may fill, and host RAM per node."""
    from finetune.plan.search import CPU_HEADROOM, GPU_HEADROOM

    e, unit = plan.estimate, plan.device
    parts = sorted(((k, v) for k, v in e.device.items() if k != LOADING), key=lambda kv: -kv[1])
    rows = [(name, f"{size / GiB:.2f}") for name, size in parts]
    rows.append(("total at the training peak", f"{e.device_bytes / GiB:.2f}"))
    kept = f"{CPU_HEADROOM:.0%} left to the OS" if unit != "GPU" else f"{GPU_HEADROOM:.0%} kept free"
    rows.append((f"usable (the {unit}'s memory less {kept})", f"{plan.device_capacity_bytes / GiB:.2f}"))
    if LOADING in e.device:
        rows.append(("peak while loading, before training (not added)", f"{e.device[LOADING] / GiB:.2f}"))
    title = f"Memory per {unit}, GiB: {e.device_bytes / plan.device_capacity_bytes:.0%} of the usable memory planned"
    if plan.device_memory_bytes:
        title += f" ({e.device_bytes / plan.device_memory_bytes:.0%} of the {plan.device_memory_bytes / GiB:.1f} GiB)"
    _table(console, title, ("component", "GiB"), rows, right=(1,))
    for note in e.notes:  # what the estimate assumes of the architecture (experts, quantized checkpoints, caches)
        _say(console, f"Model: {note}")
    if e.host:
        host = ", ".join(f"{k} {v / GiB:.1f}" for k, v in e.host.items() if k != LOADING)
        loading = f"; peak while loading, not added: {e.host[LOADING] / GiB:.1f}" if LOADING in e.host else ""
        processes = f"{plan.processes_per_node} process{'es' if plan.processes_per_node > 1 else ''}"
        _say(
            console,
            f"Host RAM per node ({processes}): {e.host_bytes / GiB:.1f} GiB of {plan.host_capacity_bytes / GiB:.1f} "
            f"usable ({host}{loading})",
        )


def _step_lines(plan: Plan) -> list[str]:
    """The step, its one estimated time by cause, the network traffic behind it and the predicted scaling."""
    from finetune.plan.comm import reduces_every_micro_batch

    ranks = (
        ("rank" if plan.data_parallel == 1 else "ranks")
        if plan.data_parallel == plan.world_size
        else "data-parallel ranks"
    )
    out = [
        f"Step: {plan.global_batch_size} sequences × {plan.seq_len} tokens = {plan.tokens_per_step:,} tokens "
        f"({plan.micro_batch_size} micro × {plan.gradient_accumulation_steps} accumulation × {plan.data_parallel} "
        f"{ranks})"
    ]
    if plan.step_seconds:
        names = {"communication": "communication not hidden behind compute"}
        parts = " + ".join(f"{names.get(k, k)} {_seconds(v)}" for k, v in plan.step_seconds.items())
        out.append(f"Step time (est.): {_seconds(sum(plan.step_seconds.values()))} = {parts}")
    if plan.communication:
        traffic = ", ".join(f"{k} {v / GiB:.2f}" for k, v in plan.communication.items())
        k = plan.gradient_accumulation_steps
        when = (
            f"; gradients reduced after each of the {k} micro-batches"
            if k > 1 and reduces_every_micro_batch(plan.backend, plan.sharding, plan.adapter)
            else ""
        )
        out.append(f"Network per rank and step, GiB: {traffic}{when}")
    if plan.scaling:
        from finetune.plan.scaling import summary

        out.append(summary(plan.scaling))
    return out


def _run_lines(plan: Plan) -> list[str]:
    """The whole run's estimated time, and a warning where it is far too long to be meant."""
    step = sum(plan.step_seconds.values())
    if not step:
        return []
    if not plan.max_steps:
        return [
            f"Run: train.epochs sets the number of steps (ft preprocess counts the rows); at {_seconds(step)} per "
            f"step, 1,000 steps take {_duration(1000 * step)}"
        ]
    total = plan.max_steps * step
    out = [f"Run: {plan.max_steps:,} steps (train.max_steps) × {_seconds(step)} ≈ {_duration(total)}"]
    cpu = plan.device != "GPU"
    if total > (LONG_CPU_RUN_SECONDS if cpu else LONG_RUN_SECONDS):
        where = (
            "this hardware has no GPU; see the plan on one with ft plan --hardware 1xH100-80GB"
            if cpu
            else "plan it on more GPUs (ft plan --hardware 2x8xH100-80GB)"
        )
        out.append(
            f"Warning: at the estimated step time this run takes {_duration(total)}: {where}, or train fewer steps "
            "or a smaller model"
        )
    return out


def _seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 1000 else f"{s:.3g} s"


def _duration(s: float) -> str:
    """Seconds in the unit a person reads them in."""
    for unit, size, limit in (("s", 1, 120), ("min", 60, 120), ("h", 3600, 48), ("days", DAY, 730)):
        if s < limit * size:
            return f"{s / size:.3g} {unit}" if unit != "s" else _seconds(s)
    return f"{s / (365 * DAY):,.1f} years"


def rollout_line(plan: Plan) -> str:
    """Where the rollouts run and the step split (plan/rollout.py; the reasons are among the decisions)."""
    r = plan.rollout
    gen, train, sync = r.generation_seconds, r.training_seconds, r.sync_seconds
    kv = f"KV cache {r.kv_cache_bytes / GiB:.2f} GiB"
    if r.placement == "inline":
        return (
            f"Rollouts: the training model samples on each rank (transformers generate), {kv} per rank; est. per "
            f"step: generation {gen:.3g} + training {train:.3g} s"
        )
    unit = "process" if plan.device != "GPU" else "GPU"
    if r.placement == "colocated":
        where = f"vLLM colocated in each training {unit}"
    elif r.placement == "ray":
        where = _ray_line(plan)
    elif r.url:
        where = f"vLLM server at {r.url}"
    else:
        where = f"vLLM on a pool of {r.server_gpus} GPUs" if r.server_gpus else "vLLM in a server process"
        where += f" (the trainer on {r.train_gpus or plan.world_size})"
    where += f", tensor parallel {r.tensor_parallel}"
    if plan.device == "GPU" and not r.url:
        where += f", memory share {r.memory_share:g}" + (", asleep during the backward pass" if r.sleep else "")
    overlap = r.asynchronous and r.placement in ("server", "ray")
    split = (
        f"max(generation {gen:.3g}, training {train:.3g})"
        if overlap
        else f"generation {gen:.3g} + training {train:.3g}"
    )
    every = f" (weights sent every {r.sync_every} steps)" if r.sync_every > 1 else ""
    return f"Rollouts: {where}, {kv} per engine; est. per step: {split} + weight sync {sync:.3g} s{every}" + (
        _staleness(r) if r.asynchronous else ""
    )


def _staleness(r) -> str:
    """How far behind the policy asynchronous rollouts are (a rollout serves num_iterations steps)."""
    if r.max_staleness == 1:
        return " (asynchronous: one rollout generated ahead, one rollout off-policy)"
    k = r.max_staleness
    return f" (asynchronous: up to {k} rollouts generated ahead, up to {k} rollouts off-policy)"


def _ray_line(plan: Plan) -> str:
    """Placement ray: which nodes train and which generate (plan/rollout.py)."""
    r, gpu = plan.rollout, plan.device == "GPU"
    train = "node 0" if plan.nodes == 1 else f"nodes 0-{plan.nodes - 1}"
    ranks = f"{plan.world_size} rank{'s' if plan.world_size > 1 else ''} ({plan.processes_per_node} per node)"
    if r.engine_nodes:
        last = plan.nodes + r.engine_nodes - 1
        nodes = f"node {plan.nodes}" if r.engine_nodes == 1 else f"nodes {plan.nodes}-{last}"
        servers = f"one vLLM server {'on' if r.engine_nodes == 1 else 'per node on'} {nodes}"
    else:
        servers = "one vLLM server on node 0"
    pool = f" ({r.server_gpus} GPUs)" if gpu else ""
    return (
        f"Ray actors: the trainer's {ranks} on {train}; {servers}{pool}, {r.engines} engine"
        f"{'s' if r.engines != 1 else ''}"
    )


def _print_candidates(console, plan: Plan) -> None:
    if not plan.alternatives:
        _say(console, "Runners-up: none (no other setup the config allows fits)")
        return
    rows = [
        (
            "the chosen setup (above)",
            f"{plan.estimate.device_bytes / GiB:.1f}",
            _seconds(sum(plan.step_seconds.values())),
        )
    ]
    rows += [(alt["setup"], f"{alt['gib']:.1f}", _seconds(alt["seconds"])) for alt in plan.alternatives]
    _table(
        console,
        "Runners-up: the best of each other setup that fits, fastest first",
        ("setup", "GiB per device", "step time (est.)"),
        rows,
        right=(1, 2),
    )


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
