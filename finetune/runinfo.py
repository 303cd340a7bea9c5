"""What a run ran on: the environment snapshot written to RUN/environment.json.

Cheap to import; torch is imported inside the function that asks it about accelerators.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from finetune.redaction import redact

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
