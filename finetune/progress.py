"""What `ft train` shows while it trains: the rich bar on a terminal, plain step lines where the output is a log.

Where stdout is not a terminal (a pipe, a file, Slurm or Kubernetes logs), rank 0 prints one line to stdout every
`output.log_steps` steps, at the last step, and after any step that ends HEARTBEAT_S seconds or more after the
previous line (so that slow steps still show progress):

    step 20/200 loss 1.2345 lr 2.00e-04 tok/s 12,345 mem 3.2 GiB eta 0:04:10 rewards/margin 0.8123 rewards/accuracy 0.75

The fixed fields come first, in that order, then, for a mixture-of-experts model, its router's load-balancing loss
(`aux`) and the smallest and largest share of a layer's tokens one expert took since the last logged step
(`experts 12%-41%`, methods/router.py), then the method's own metrics (its section's `progress_metrics`, under
their metrics.jsonl names; the bar's text shows the same). tok/s is measured over the steps since the previous line;
mem is the peak device memory on GPUs, the process's peak resident memory on CPUs; eta extrapolates the wall time
per step since training started. A field the step did not report is left out. Cheap to import.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence

HEARTBEAT_S = 30.0  # a line at least this often (at the end of a step) when steps are slower than log_steps


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def expand(patterns: Sequence[str], keys: Iterable[str]) -> list[str]:
    """The keys that `patterns` name, in the patterns' order: a name stands for itself where present, `prefix/*` for
    every key under prefix/ (in the order of `keys`)."""
    keys = list(dict.fromkeys(keys))
    shown: list[str] = []
    for pattern in patterns:
        if pattern.endswith("/*"):
            shown += [k for k in keys if k.startswith(pattern[:-1]) and k not in shown]
        elif pattern in keys and pattern not in shown:
            shown.append(pattern)
    return shown


def method_fields(patterns: Sequence[str], row: dict) -> list[tuple[str, float]]:
    """The method's metrics to show from `row`, as (name, value) pairs."""
    return [(k, row[k]) for k in expand(patterns, row) if is_number(row[k])]


def number_text(value: float) -> str:
    """A method metric: 4 significant digits (0.5, 7.25, 0.0001234)."""
    return f"{value:.4g}"


def clock_text(seconds: float) -> str:
    """0:04:10; `?` before there is anything to extrapolate from."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))


def step_line(step: int, total: int, row: dict, patterns: Sequence[str] = (), tokens_per_s=None, eta_s=None) -> str:
    """One plain progress line (the format is stable: tools grep it)."""
    parts = [f"step {step}/{total}"]
    if is_number(row.get("loss")):
        parts.append(f"loss {row['loss']:.4f}")
    if is_number(row.get("lr")):
        parts.append(f"lr {row['lr']:.2e}")
    tokens_per_s = row.get("tokens_per_s") if tokens_per_s is None else tokens_per_s
    if is_number(tokens_per_s):
        parts.append(f"tok/s {tokens_per_s:,.0f}")
    if is_number(row.get("memory_gib")):
        parts.append(f"mem {row['memory_gib']:.1f} GiB")
    if eta_s is not None:
        parts.append(f"eta {clock_text(eta_s)}")
    parts += expert_fields(row)
    parts += [f"{name} {number_text(value)}" for name, value in method_fields(patterns, row)]
    return " ".join(parts)


def expert_fields(row: dict) -> list[str]:
    """A mixture-of-experts model's figures: the load-balancing loss and the expert shares (min-max)."""
    parts = [f"aux {number_text(row['aux_loss'])}"] if is_number(row.get("aux_loss")) else []
    low, high = row.get("experts/min_share"), row.get("experts/max_share")
    if is_number(low) and is_number(high):
        parts.append(f"experts {low:.0%}-{high:.0%}")
    return parts


class StepLines:
    """The per-step callback that prints plain lines: every `log_steps` steps, at the last step, and at least every
    `heartbeat` seconds (checked when a step ends)."""

    def __init__(
        self,
        log_steps: int,
        patterns: Sequence[str] = (),
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: float = HEARTBEAT_S,
    ):
        self.log_steps, self.patterns, self.heartbeat, self.clock = log_steps, tuple(patterns), heartbeat, clock
        self.write = write or _print_line
        self.started = self.last_line = clock()
        self.first: int | None = None  # the step before the first this process trains (a resumed run starts later)
        self.tokens = 0
        self.latest: dict = {}  # the newest value of each metric (a step may report only some)

    def __call__(self, step: int, total: int, row: dict) -> None:
        now = self.clock()
        if self.first is None:
            self.first = step - 1
        self.latest.update(row)
        self.tokens += row.get("tokens", 0) if is_number(row.get("tokens")) else 0
        if step % self.log_steps and step < total and now - self.last_line < self.heartbeat:
            return
        seconds = now - self.last_line
        tokens_per_s = self.tokens / seconds if self.tokens and seconds > 0 else None
        eta_s = (total - step) * (now - self.started) / max(step - self.first, 1)
        self.write(step_line(step, total, self.latest, self.patterns, tokens_per_s, eta_s))
        self.tokens, self.last_line = 0, now


def _print_line(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def wants_lines(console) -> bool:
    """Plain lines unless both stdout and the bar's stream are terminals (where the bar is enough)."""
    return not (console.is_terminal and sys.stdout.isatty())


@contextlib.contextmanager
def progress(console, total: int, log_steps: int, patterns: Sequence[str] = ()):
    """Yields the per-step callback: the rich bar where `console` is a terminal, plain lines on stdout where stdout
    (or the console) is not one; both where only stdout goes to a log."""
    lines = StepLines(log_steps, patterns) if wants_lines(console) else None
    with _bar(console, total, patterns) if console.is_terminal else contextlib.nullcontext(None) as bar:

        def on_step(step: int, total: int, row: dict) -> None:
            if bar is not None:
                bar(step, total, row)
            if lines is not None:
                lines(step, total, row)

        yield on_step


@contextlib.contextmanager
def _bar(console, total: int, patterns: Sequence[str]):
    """A progress bar with the loss, the method's metrics (short names: `margin` for rewards/margin), tokens/s and the
    ETA; yields the per-step callback."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}{task.fields[extra]}  {task.fields[tps]:,.0f} tok/s", markup=False),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    latest: dict = {}
    with Progress(*columns, console=console) as shown:
        task = shown.add_task("train", total=total, loss=float("nan"), tps=0.0, extra="")

        def update(step: int, _total: int, row: dict) -> None:
            latest.update(row)
            extra = "".join(f"  {k.split('/')[-1]} {number_text(v)}" for k, v in method_fields(patterns, latest))
            loss, tps = latest.get("loss", float("nan")), latest.get("tokens_per_s", 0.0)
            shown.update(task, completed=step, loss=loss, tps=tps, extra=extra)

        yield update
