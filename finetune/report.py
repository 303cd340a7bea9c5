"""Printing a Plan for people (rich tables) or programs (JSON)."""

from __future__ import annotations

import json
import shlex
import sys

from finetune.plan.memory import GiB
from finetune.plan.plan import Plan


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


def print_plan(plan: Plan, as_json: bool = False, candidates: bool = False) -> None:
    if as_json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    e = plan.estimate
    console.print(f"[bold]{plan.model}[/] · {plan.method} · on {plan.hardware}")
    console.print(
        f"{e.total_params:,} parameters, {e.trainable_params:,} trained "
        f"({100 * e.trainable_params / e.total_params:.2f}%)"
    )

    choices = Table(title="Decisions", title_justify="left", show_lines=False)
    for col in ("choice", "value", "by", "why"):
        choices.add_column(col, overflow="fold")
    for d in plan.decisions:
        choices.add_row(d.field, _fmt(d.value), "you" if d.source == "config" else "ft", d.reason)
    console.print(choices)

    memory = Table(title=f"Memory per {plan.device}", title_justify="left")
    memory.add_column("component")
    memory.add_column("GiB", justify="right")
    for name, size in sorted(e.device.items(), key=lambda kv: -kv[1]):
        memory.add_row(name, f"{size / GiB:.2f}")
    used = e.device_bytes / plan.device_capacity_bytes
    memory.add_row("[bold]total[/]", f"[bold]{e.device_bytes / GiB:.2f}[/]")
    memory.add_row("usable", f"{plan.device_capacity_bytes / GiB:.2f} ({100 * used:.0f}% used)")
    console.print(memory)
    if e.host:
        host = ", ".join(f"{k} {v / GiB:.1f}" for k, v in e.host.items())
        console.print(
            f"Host RAM per node: {e.host_bytes / GiB:.1f} GiB of {plan.host_capacity_bytes / GiB:.1f} usable ({host})"
        )
    console.print(
        f"Step: {plan.global_batch_size} sequences × {plan.seq_len} tokens = {plan.tokens_per_step:,} tokens "
        f"({plan.micro_batch_size} micro × {plan.gradient_accumulation_steps} accumulation × {plan.data_parallel} "
        f"{'ranks' if plan.data_parallel == plan.world_size else 'data-parallel ranks'})"
    )
    if plan.communication:
        traffic = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in plan.communication.items())
        console.print(
            f"Network per rank and step: {traffic} (about {plan.communication_seconds:.2f} s at the bandwidths "
            "assumed in plan/comm.py)"
        )
    if plan.step_seconds:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in plan.step_seconds.items())
        console.print(f"Estimated step time: {sum(plan.step_seconds.values()):.3g} s ({parts})")
    if plan.scaling:
        from finetune.plan.scaling import summary

        console.print(summary(plan.scaling))
    if plan.rollout:
        console.print(rollout_line(plan))
    if plan.stop_seconds:
        console.print(
            f"Stopping: {plan.checkpoint_bytes / GiB:.1f} GiB per node per checkpoint; {plan.stop_seconds} s from a "
            "stop signal to a complete checkpoint (the warning ft launch asks a scheduler for)"
        )
    if plan.device == "GPU":
        console.print(f"Assumptions: {assumptions()}", style="dim")
    if candidates:
        _print_candidates(console, plan)
    console.print(
        "Launch: "
        + " ".join(shlex.quote(a) if not a.startswith("--node-rank=$") and "$" not in a else a for a in plan.launch),
        soft_wrap=True,
    )


def rollout_line(plan: Plan) -> str:
    """Where the rollouts run and the step split (plan/rollout.py; the reasons are among the decisions)."""
    r = plan.rollout
    gen, train, sync = r["generation_seconds"], r["training_seconds"], r["sync_seconds"]
    kv = f"KV cache {r['kv_cache_bytes'] / GiB:.2f} GiB"
    if r["placement"] == "inline":
        return (
            f"Rollouts: the training model samples on each rank (transformers generate), {kv} per rank; est. per "
            f"step: generation {gen:.3g} + training {train:.3g} s"
        )
    unit = "process" if plan.device != "GPU" else "GPU"
    if r["placement"] == "colocated":
        where = f"vLLM colocated in each training {unit}"
    elif r["url"]:
        where = f"vLLM server at {r['url']}"
    else:
        where = f"vLLM on a pool of {r['server_gpus']} GPUs" if r["server_gpus"] else "vLLM in a server process"
        where += f" (the trainer on {r['train_gpus'] or plan.world_size})"
    where += f", tensor parallel {r['tensor_parallel']}"
    if plan.device == "GPU" and not r["url"]:
        where += f", memory share {r['memory_share']:g}" + (", asleep during the backward pass" if r["sleep"] else "")
    overlap = r["asynchronous"] and r["placement"] == "server"
    split = (
        f"max(generation {gen:.3g}, training {train:.3g})"
        if overlap
        else f"generation {gen:.3g} + training {train:.3g}"
    )
    every = f" (weights sent every {r['sync_every']} steps)" if r["sync_every"] > 1 else ""
    return f"Rollouts: {where}, {kv} per engine; est. per step: {split} + weight sync {sync:.3g} s{every}" + (
        " (asynchronous: one step off-policy)" if r["asynchronous"] else ""
    )


def _print_candidates(console, plan: Plan) -> None:
    from rich.table import Table

    if not plan.alternatives:
        console.print("Runners-up: none (no other setup the config allows fits)")
        return
    table = Table(title="Runners-up (the best of each other setup that fits, fastest first)", title_justify="left")
    for col, justify in (("setup", "left"), ("GiB per device", "right"), ("s per step", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    chosen = sum(plan.step_seconds.values())
    table.add_row("[bold]chosen[/]", f"{plan.estimate.device_bytes / GiB:.1f}", f"{chosen:.3g}")
    for alt in plan.alternatives:
        table.add_row(alt["setup"], f"{alt['gib']:.1f}", f"{alt['seconds']:.3g}")
    console.print(table)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
