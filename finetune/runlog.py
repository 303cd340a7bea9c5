"""What ft writes into a run folder besides the model: environment, metrics, loss plot, model card (and redaction,
from `finetune.redaction`).

Everything here is cheap to import; matplotlib and torch are imported inside the functions that use them.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from finetune.errors import FtError
from finetune.redaction import REDACTED, SECRET_KEY, is_config, redact, redact_config

__all__ = ["REDACTED", "SECRET_KEY", "redact", "redact_config"]  # redaction lives in finetune.redaction


# ---------------------------------------------------------------- environment
PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "datasets",
    "bitsandbytes",
    "deepspeed",
    "trl",
    "tokenizers",
    "safetensors",
    "finetune",
)
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "HF_HUB_ENABLE_HF_TRANSFER",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "WANDB_MODE",
    "WANDB_PROJECT",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
)
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "PYTORCH_", "ACCELERATE_", "FI_")


def environment_snapshot(cwd: str | Path = ".") -> dict:
    """What the run ran on: Python, platform, package versions, accelerators, git state, relevant env vars.

    The hostname and user name are left out on purpose; environment variables pass through `redact`.
    """
    git_commit, git_dirty = _git_state(Path(cwd))
    env = {k: v for k, v in os.environ.items() if k in ENV_VARS or k.startswith(ENV_PREFIXES)}
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "packages": {name: _version(name) for name in PACKAGES},
        "accelerator": _accelerator(),
        "git_commit": git_commit,
        "git_dirty": git_dirty,
        "env": redact(dict(sorted(env.items()))),
    }


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _accelerator() -> dict | None:
    """torch's CUDA/ROCm build and the visible GPUs; None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    info: dict[str, Any] = {"cuda": torch.version.cuda, "rocm": getattr(torch.version, "hip", None), "gpus": []}
    try:
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:  # a broken driver must not stop the snapshot
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def _git_state(cwd: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the repository holding `cwd`; (None, None) outside one or without git."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    if not commit or not re.fullmatch(r"[0-9a-f]{40,64}", commit):
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


# ---------------------------------------------------------------- metrics
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


# ---------------------------------------------------------------- loss plot
def plot_losses(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """Train loss (and eval loss) against step, with the learning rate on a second axis, as a PNG.

    Returns the PNG's path, or None (writing nothing) when the metrics hold no loss.
    """
    records = read_metrics(metrics_path)
    series = {name: _points(records, name) for name in ("loss", "eval_loss", "lr")}
    if not series["loss"] and not series["eval_loss"]:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise FtError(f"Plotting the loss needs matplotlib ({e}).\n    fix: pip install matplotlib") from None

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lines = []
    for name, label, style in (("loss", "train loss", "-"), ("eval_loss", "eval loss", "o-")):
        if series[name]:
            lines += ax.plot(*zip(*series[name]), style, label=label, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if series["lr"]:
        ax2 = ax.twinx()
        lines += ax2.plot(*zip(*series["lr"]), "--", color="tab:gray", label="learning rate", linewidth=1)
        ax2.set_ylabel("learning rate")
        ax2.set_ylim(bottom=0)
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    ax.legend(
        lines,
        [line.get_label() for line in lines],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(lines),
        frameon=False,
    )
    fig.tight_layout()
    _atomic_write(Path(out_png), lambda f: fig.savefig(f, format="png"), binary=True)
    return Path(out_png)


def _points(records: list[dict], name: str) -> list[tuple[int, float]]:
    return [
        (r["step"], r[name])
        for r in records
        if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool) and "step" in r
    ]


# ---------------------------------------------------------------- files
def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never half of it."""
    _atomic_write(Path(path), lambda f: f.write(text), binary=False)


def _atomic_write(path: Path, write, binary: bool) -> None:
    """Write through `write(file)` into a temporary file next to `path`, fsync it, then rename it over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- model card
def model_card(run: dict) -> str:
    """README.md for the final model, from {"config", "plan", "data", "metrics", "artifact"} (all optional),
    plus optional "name" (title), "run_dir" (for `ft merge-lora`) and "path" (where the weights are).

    "config" is best the job's `Config` itself: then the text its `${VAR}` references read from the
    environment is shown as the reference everywhere in the card, not only in the config.
    """
    job = run.get("config")
    run = redact(
        {**run, "config": redact_config(job)} if is_config(job) else run, config=job if is_config(job) else None
    )
    cfg, plan, data, metrics = (run.get(k) or {} for k in ("config", "plan", "data", "metrics"))
    base = (cfg.get("model") or {}).get("name") or plan.get("model") or "(base model not recorded)"
    adapter = {**(cfg.get("adapter") or {})}
    adapter["type"] = plan.get("adapter") or adapter.get("type") or "lora"
    artifact = run.get("artifact") or ("model" if adapter["type"] == "full" else "adapter")
    method = (cfg.get("method") or {}).get("name") or plan.get("method") or "sft"
    title = run.get("name") or (cfg.get("output") or {}).get("run_name") or f"{base} fine-tuned with ft"
    kind = _ADAPTER_NAMES.get(adapter["type"], adapter["type"])
    what = f"a {kind} adapter for" if artifact == "adapter" else "a fully fine-tuned"
    front = {
        "base_model": base,
        "library_name": "peft" if artifact == "adapter" else "transformers",
        "tags": ["ft", method] + ([adapter["type"]] if artifact == "adapter" else []),
    }
    parts = [
        "---\n" + "".join(f"{k}: {json.dumps(v)}\n" for k, v in front.items()) + "---",
        f"# {title}",
        f"This is {what} `{base}`, trained with ft ({method.upper()}).",
        "## Model\n\n" + _table(_model_rows(cfg, plan, adapter, artifact, base)),
        "## Data\n\n" + _table(_data_rows(cfg, data)),
        "## Training\n\n" + _table(_training_rows(cfg, plan)),
        "## Results\n\n" + _table(_result_rows(metrics)),
        _usage(base, artifact, run, data),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


_ADAPTER_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}


def _table(rows: list[tuple[str, Any]]) -> str:
    rows = [(k, v) for k, v in rows if v not in (None, "", [])]
    if not rows:
        return "_not recorded_"
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows)


def _model_rows(cfg: dict, plan: dict, adapter: dict, artifact: str, base: str) -> list:
    model = cfg.get("model") or {}
    rows = [
        ("base model", f"`{base}`"),
        ("revision", model.get("revision")),
        ("method", ((cfg.get("method") or {}).get("name") or plan.get("method") or "").upper()),
        (
            "trained",
            "all weights" if artifact == "model" else f"{_ADAPTER_NAMES.get(adapter['type'], adapter['type'])} adapter",
        ),
    ]
    if artifact == "adapter":
        targets = adapter.get("target_modules")
        rows += [
            ("rank r / alpha", f"{adapter.get('r', '?')} / {adapter.get('alpha', '?')}"),
            ("target modules", ", ".join(targets) if isinstance(targets, list) else targets),
            ("dropout", adapter.get("dropout")),
            ("DoRA", "yes" if adapter.get("dora") else None),
            ("rsLoRA", "yes" if adapter.get("rslora") else None),
            ("modules trained in full", ", ".join(adapter.get("modules_to_save") or [])),
        ]
    rows.append(
        ("base quantization", plan.get("quantization") if plan.get("quantization") not in (None, "none") else None)
    )
    params = plan.get("params") or {}
    if params.get("total") and params.get("trainable"):
        rows.append(
            (
                "trained parameters",
                f"{params['trainable']:,} of {params['total']:,} ({100 * params['trainable'] / params['total']:.2f}%)",
            )
        )
    return rows


def _data_rows(cfg: dict, data: dict) -> list:
    sources = data.get("sources") or (cfg.get("data") or {}).get("datasets") or []
    rows = [(f"source {i + 1}", _source(s)) for i, s in enumerate(sources)]
    names = (
        ("train_samples", "training samples"),
        ("validation_samples", "validation samples"),
        ("tokens_per_epoch", "tokens per epoch"),
        ("trained_tokens_per_epoch", "trained tokens per epoch"),
        ("packed_rows", "packed rows"),
    )
    rows += [(label, f"{data[k]:,}" if isinstance(data.get(k), int) else data.get(k)) for k, label in names]
    rows.append(("special tokens added", ", ".join(data.get("added_tokens") or [])))
    return rows


def _source(s: Any) -> str:
    if not isinstance(s, dict):
        return f"`{s}`"
    extra = [f"{k} {s[k]}" for k in ("format", "subset", "split") if s.get(k)]
    if s.get("samples"):
        extra.append(f"{s['samples']} samples")
    elif s.get("weight") not in (None, 1, 1.0):
        extra.append(f"weight {s['weight']}")
    return f"`{s.get('path', '?')}`" + (f" ({', '.join(extra)})" if extra else "")


def _training_rows(cfg: dict, plan: dict) -> list:
    train, data = cfg.get("train") or {}, cfg.get("data") or {}
    batch = None
    if all(k in plan for k in ("micro_batch_size", "gradient_accumulation_steps", "world_size", "global_batch_size")):
        batch = (
            f"{plan['micro_batch_size']} micro × {plan['gradient_accumulation_steps']} accumulation × "
            f"{plan['world_size']} ranks = {plan['global_batch_size']} sequences per step"
        )
    backend = plan.get("backend")
    if backend and plan.get("sharding") not in (None, "none"):
        backend = f"{backend} ({plan['sharding']})"
    seq_len = plan.get("seq_len") or data.get("seq_len")
    return [
        ("hardware", plan.get("hardware")),
        ("precision", plan.get("precision") or train.get("precision")),
        ("backend", backend),
        ("offload", plan.get("offload_target") if plan.get("offload") else None),
        ("batch", batch),
        ("sequence length", f"{seq_len}{', packed' if data.get('packing') else ''}" if seq_len else None),
        ("learning rate", _g(plan.get("lr") or train.get("lr"))),
        ("schedule / optimizer", " / ".join(str(train[k]) for k in ("scheduler", "optimizer") if train.get(k))),
        ("gradient checkpointing", {True: "on", False: "off"}.get(plan.get("gradient_checkpointing"))),
    ]


def _g(value: Any) -> Any:
    return f"{value:g}" if isinstance(value, float) else value


def _result_rows(metrics: dict) -> list:
    def loss(v):
        return f"{v:.4f}" if isinstance(v, (int, float)) and math.isfinite(v) else None

    seconds = metrics.get("seconds")
    duration = None
    if isinstance(seconds, (int, float)):
        h, rest = divmod(int(round(seconds)), 3600)
        duration = f"{h}h {rest // 60:02d}m {rest % 60:02d}s"
    return [
        ("final train loss", loss(metrics.get("final_loss"))),
        ("final eval loss", loss(metrics.get("final_eval_loss"))),
        ("optimizer steps", metrics.get("steps")),
        ("training time", duration),
    ]


def _usage(base: str, artifact: str, run: dict, data: dict) -> str:
    run_dir = run.get("run_dir") or "RUN"
    path = run.get("path") or f"{run_dir}/final"
    if artifact == "model":
        return (
            "## Use\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{path}", dtype="auto")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{path}")\n```'
        )
    resize = "base.resize_token_embeddings(len(tokenizer))\n" if data.get("added_tokens") else ""
    return (
        "## Use\n\n```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, "
        "AutoTokenizer\n\n"
        f'tokenizer = AutoTokenizer.from_pretrained("{path}")\n'
        f'base = AutoModelForCausalLM.from_pretrained("{base}", dtype="auto")\n{resize}'
        f'model = PeftModel.from_pretrained(base, "{path}")\n```\n\n'
        f"To merge the adapter into the base weights for a standalone model: `ft merge-lora {run_dir}`"
    )
