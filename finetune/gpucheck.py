"""GPUs that torch cannot use: nvidia-smi lists them, torch sees none (a driver older than torch's CUDA needs, a
CPU-only torch, GPUs not passed into a container). ft refuses to plan for the CPU then: `probe()` (ft plan and
ft train on this machine) calls `require_usable_gpus`, and so does the CUDA image's entrypoint
(`python -m finetune.gpucheck`), so that the container fails at start with the reason and the fix.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

ALLOW_CPU_WITH_GPUS = "FT_ALLOW_CPU_WITH_GPUS"  # =1: run on the CPU although nvidia-smi lists GPUs
# The oldest driver branch each CUDA major runs on: by CUDA's minor-version compatibility any 12.x runtime runs on
# R525 and newer, any 13.x on R580 and newer (CUDA toolkit release notes; docker/README.md's drivers table).
MIN_DRIVER_FOR_CUDA = {12: 525, 13: 580}


def require_usable_gpus(torch: Any = None) -> None:
    """Raise HardwareError when nvidia-smi lists GPUs that torch cannot use, unless FT_ALLOW_CPU_WITH_GPUS=1.
    probe() (`ft plan`/`ft train` on this machine) and the CUDA image's entrypoint (`python -m finetune.hardware`)
    call it, so that a driver too old for torch's CUDA fails loudly instead of planning for the CPU."""
    problem = None if os.environ.get(ALLOW_CPU_WITH_GPUS) == "1" else gpu_visibility_problem(torch)
    if problem:
        from finetune.errors import HardwareError

        raise HardwareError(problem)


def gpu_visibility_problem(torch: Any = None) -> str | None:
    """Why torch cannot use the GPUs `nvidia-smi -L` lists, or None: no nvidia-smi, no GPU listed, GPUs hidden on
    purpose (CUDA_VISIBLE_DEVICES empty or -1), or torch sees them. torch is imported only once GPUs are listed."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip()
    if not hidden or hidden.startswith("-"):
        return None
    count = len(re.findall(r"^GPU \d+:", _nvidia_smi("-L"), re.MULTILINE))
    torch = _import_torch() if torch is None and count else torch
    if not count or torch is None or torch.cuda.is_available():
        return None
    driver = (_nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").split() or ["unknown"])[0]
    return _invisible_gpus_message(count, driver, torch)


def _invisible_gpus_message(count: int, driver: str, torch: Any) -> str:
    cuda = getattr(torch.version, "cuda", None)
    cuda_major, driver_major = (re.match(r"\d+", text or "") for text in (cuda, driver))
    need = MIN_DRIVER_FOR_CUDA.get(int(cuda_major.group())) if cuda_major else None
    fix = (
        f"run the image built for CUDA 12.x (make image-cuda CUDA_VERSION=12.8.1, tag …-cu128-…; runs on driver "
        f"{MIN_DRIVER_FOR_CUDA[12]} and newer) or torch from https://download.pytorch.org/whl/cu128, or update the "
        f"NVIDIA driver to {MIN_DRIVER_FOR_CUDA[max(MIN_DRIVER_FOR_CUDA)]} or newer"
    )
    if cuda is None:
        cause, fix = "is a CPU-only build", "install torch's CUDA build (https://download.pytorch.org/whl/cu128)"
    elif need and driver_major and int(driver_major.group()) < need:
        cause = f"is built for CUDA {cuda}, which needs driver {need} or newer"
    else:
        cause = f"(CUDA {cuda}) cannot start CUDA: {_torch_cuda_error(torch)}"
        fix = f"check that the GPUs are passed in (docker run --gpus all) and that the driver works; or {fix}"
    return (
        f"nvidia-smi lists {count} GPU{'s' * (count > 1)} (driver {driver}), but torch "
        f"{getattr(torch, '__version__', '?')} {cause}, so ft would plan for the CPU.\n    fix: {fix}.\n"
        f"    To run on the CPU anyway, set {ALLOW_CPU_WITH_GPUS}=1."
    )


def _nvidia_smi(*args: str) -> str:
    """nvidia-smi's output, or "" when it is missing, fails or hangs (it can, on a GPU in a bad state)."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return ""
    import subprocess

    try:
        done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _torch_cuda_error(torch: Any) -> str:
    """The first line of torch's own reason (torch.cuda.init() raises it)."""
    try:
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - whatever torch says is the reason to show
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return "torch.cuda.is_available() is False; python -c 'import torch; torch.cuda.init()' says why"


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


if __name__ == "__main__":
    from finetune.errors import run_main

    run_main(require_usable_gpus, "the GPU check")
