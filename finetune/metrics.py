"""metrics.jsonl (one JSON record per logged step) and the loss plot drawn from it.

Cheap to import; matplotlib is imported inside the function that draws.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from finetune.errors import FtError
from finetune.files import atomic_write, atomic_write_text


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl: {"step", "time", **metrics}.

    With `resume_from_step`, records after that step (from the interrupted run) are removed first, so a
    resumed run never writes a step twice.
    """

    def __init__(self, path: str | Path, resume_from_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_from_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", -1) <= resume_from_step]
            atomic_write_text(self.path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
        needs_newline = self.path.exists() and self.path.stat().st_size > 0 and not _ends_with_newline(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        if needs_newline:  # a line cut short by a crash stays on its own line
            self._file.write("\n")

    def log(self, step: int, **metrics: Any) -> None:
        if self._file is None:
            raise ValueError(f"MetricsWriter for {self.path} is closed")
        record = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: _clean(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clean(value: Any) -> Any:
    """A JSON-ready metric: tensors and numpy scalars become numbers, floats keep 6 significant digits,
    NaN and infinity become null."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    return value


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; [] when it does not exist. A line cut short at the end is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if any(rest.strip() for rest in lines[number:]):
                raise FtError(f"{path}:{number}: not a JSON record ({e.msg}); fix or delete that line") from None
    return records


def plot_losses(metrics_path: str | Path, out_png: str | Path, shown: Sequence[str] = ()) -> Path | None:
    """Train loss (and eval loss) against step, with the learning rate on a second axis, as a PNG; below it, where
    logged, the method's rewards among `shown` (its section's `progress_metrics`: GRPO's mean reward and each reward
    function's, a preference method's margin and accuracy), in a second panel of the same PNG.

    Returns the PNG's path, or None (writing nothing) when the metrics hold neither a loss nor such a reward.
    """
    records = read_metrics(metrics_path)
    series = {name: _points(records, name) for name in ("loss", "eval_loss", "lr")}
    rewards = {name: _points(records, name) for name in _reward_names(shown, records)}
    if not series["loss"] and not series["eval_loss"] and not rewards:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise FtError(f"Plotting the loss needs matplotlib ({e}).\n    fix: pip install matplotlib") from None

    fig = Figure(figsize=(8, 7.5 if rewards else 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if rewards else fig.add_subplot()
    _loss_panel(ax, series)
    if rewards:
        _reward_panel(fig.add_subplot(2, 1, 2, sharex=ax), rewards)
    fig.tight_layout()
    atomic_write(Path(out_png), lambda f: fig.savefig(f, format="png"), binary=True)
    return Path(out_png)


def _reward_names(shown: Sequence[str], records: list[dict]) -> list[str]:
    """The metrics among `shown` that are rewards (reward, rewards/...) and were logged."""
    from finetune.progress import expand

    keys = dict.fromkeys(k for r in records for k in r)
    return [k for k in expand(shown, keys) if k.split("/")[0] in ("reward", "rewards")]


def _loss_panel(ax, series: dict) -> None:
    lines = []
    for name, label, style in (("loss", "train loss", "-"), ("eval_loss", "eval loss", "o-")):
        if series[name]:
            lines += ax.plot(*zip(*series[name]), style, label=label, markersize=3)
    if series["lr"]:
        ax2 = ax.twinx()
        lines += ax2.plot(*zip(*series["lr"]), "--", color="tab:gray", label="learning rate", linewidth=1)
        ax2.set_ylabel("learning rate")
        ax2.set_ylim(bottom=0)
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    _finish(ax, lines, "loss")


def _reward_panel(ax, rewards: dict) -> None:
    lines = []
    for name, points in rewards.items():
        if points:
            lines += ax.plot(*zip(*points), "-", label=name, linewidth=2 if name == "reward" else 1)
    _finish(ax, lines, "rewards")


def _finish(ax, lines: list, ylabel: str) -> None:
    """A panel's axis labels, grid and legend."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(
        lines,
        [line.get_label() for line in lines],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=min(len(lines), 4),
        frameon=False,
    )


def _points(records: list[dict], name: str) -> list[tuple[int, float]]:
    return [
        (r["step"], r[name])
        for r in records
        if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool) and "step" in r
    ]
