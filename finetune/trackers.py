"""Experiment trackers (output.trackers): TensorBoard, Weights & Biases, MLflow, behind one small interface.

Only rank 0 logs. A missing package or a tracker that cannot start is an FtError at construction, before
any training time is spent; a tracker that fails later (a network outage) is warned about once and dropped,
so training goes on.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from finetune.artifacts.run import RunFolder
from finetune.errors import FtError, Problem
from finetune.redaction import is_config, redact

log = logging.getLogger(__name__)

# tracker -> module that must import for it to work (the pip extra has the tracker's name)
MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
KEY = ("output", "trackers")


def check_installed(names: list[str]) -> None:
    """Raise FtError naming every configured tracker that is unknown or whose package does not import."""
    problems = []
    for name in names:
        if name not in MODULES:
            problems.append(Problem((KEY,), f"unknown tracker {name!r}", f"use one of {', '.join(MODULES)}"))
            continue
        try:
            importlib.import_module(MODULES[name])
        except ImportError as e:
            problems.append(
                Problem(
                    (KEY,),
                    f"{name!r} is configured but its package does not import ({e})",
                    f"pip install 'finetune[{name}]', or remove {name!r} from output.trackers",
                )
            )
    if problems:
        raise FtError("\n".join(p.render() for p in problems))


class Trackers:
    """Sends each step's metrics to the configured trackers. A no-op on ranks other than 0.

    `config` is best the job's `Config` itself: then values its `${VAR}` references read from the
    environment reach no tracker (they are shown as the reference, in the config and in the run name).
    """

    def __init__(self, names: list[str], run_dir: Path, run_name: str, config: Any, rank: int = 0):
        self._sinks: dict[str, Any] = {}
        if rank != 0 or not names:
            return
        names = list(dict.fromkeys(names))
        check_installed(names)
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if is_config(config):
            run_name = redact(run_name, config=config)
        config = redact(config)
        for name in names:
            try:
                self._sinks[name] = _SINKS[name](run_dir, run_name, config)
            except Exception as e:
                self.close(failed=True)
                fix = f"pip install 'finetune[{name}]'" if isinstance(e, ImportError) else _START_FIX[name]
                raise FtError(
                    f"output.trackers: {name} could not start: {type(e).__name__}: {e}\n    fix: {fix}"
                ) from e

    @property
    def active(self) -> list[str]:
        """Trackers still being logged to."""
        return list(self._sinks)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        numbers = _numbers(metrics)
        if not numbers:
            return
        for name, sink in list(self._sinks.items()):
            try:
                sink.log(step, numbers)
            except Exception as e:
                log.warning(
                    "tracker %s failed at step %d (%s: %s); ft stops logging to it, training goes on "
                    "(metrics.jsonl still has every step)",
                    name,
                    step,
                    type(e).__name__,
                    e,
                )
                self._sinks.pop(name, None)
                _close_quietly(name, sink, failed=True)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run; `failed` marks the run as failed where the tracker knows that."""
        sinks, self._sinks = self._sinks, {}
        for name, sink in sinks.items():
            _close_quietly(name, sink, failed)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(failed=exc_type is not None)


def _numbers(metrics: dict) -> dict[str, float]:
    """The numeric metrics (tensors and numpy scalars included); None, strings and booleans are left out."""
    out = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item):
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[str(key)] = float(value)
    return out


def _close_quietly(name: str, sink, failed: bool) -> None:
    try:
        sink.close(failed)
    except Exception as e:
        log.warning("tracker %s did not close cleanly (%s: %s)", name, type(e).__name__, e)


_START_FIX = {
    "tensorboard": "check that the run folder is writable",
    "wandb": "run `wandb login` or set WANDB_API_KEY in the environment (never in the job file), "
    "or set WANDB_MODE=offline and `wandb sync` later",
    "mlflow": "check MLFLOW_TRACKING_URI (unset it to log to mlflow.db in the run folder) and the server's credentials",
}


# ---------------------------------------------------------------- one class per tracker
class _TensorBoard:
    def __init__(self, run_dir: Path, run_name: str, config: dict):
        import json

        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(RunFolder(run_dir).tracker_path("tensorboard")))
        self.writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, failed: bool) -> None:
        self.writer.flush()
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, run_name: str, config: dict):
        import wandb

        # The API key comes from wandb's own login or WANDB_API_KEY; WANDB_MODE=offline needs none.
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "ft", name=run_name, dir=str(run_dir), config=config
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    def __init__(self, run_dir: Path, run_name: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # Without a server, a SQLite store in the run folder (MLflow 3 refuses its old ./mlruns file store).
        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if not uri:
            folder = RunFolder(run_dir)
            uri = f"sqlite:///{folder.tracker_path('mlflow.db').resolve().as_posix()}"
            artifacts = folder.tracker_path("mlartifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ft"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name, artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(re.sub(r"[^\w\-. /:]", "_", k)[:250], v[:500]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


_SINKS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 1e-4}, "data": {"datasets": [{"path": "x"}]}} -> {"train.lr": "0.0001", "data.datasets.0.path":
    "x"}."""
    if isinstance(config, dict):
        items = config.items()
    elif isinstance(config, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in config):
        items = enumerate(config)
    else:
        return {prefix or "value": str(config)}
    out: dict[str, str] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out
