"""Checkpoints: written atomically, newest K kept, everything needed to resume exactly.

RUN/checkpoints/step-00000100/
    trainable.safetensors   the parameters being trained (adapter weights, or the whole model)
    optimizer.pt, scheduler.pt, rng.pt
    state.json              step, data position, tokens seen, ... (written last: its presence marks a complete
    checkpoint)
A checkpoint is written into a hidden temporary folder and renamed into place, so a crash or a full
disk mid-save never leaves a folder that looks complete, and older checkpoints are deleted only
after the new one is in place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

from finetune.errors import FtError

PATTERN = re.compile(r"^step-(\d{8})$")


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if PATTERN.match(p.name) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(PATTERN.match(p.name).group(1)))


def latest(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def trainable_state(model) -> dict:
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict:
    """Every RNG's state as tensors and plain numbers, so that it loads with torch.load(weights_only=True)."""
    import numpy as np
    import torch

    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_tensors(path: Path):
    """A checkpoint file written by torch.save: tensors and plain data only (weights_only: no code runs while
    unpickling), onto the CPU (on GPUs, without map_location every rank's state would land where it was saved)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise FtError(
            f"checkpoint file {path} cannot be read safely ({first}): it holds something other than tensors and "
            "plain data, "
            "or it is damaged. ft loads checkpoints with weights_only=True and never runs code from them; resume "
            "from another "
            "checkpoint (delete this one) or start a new output.dir"
        ) from None


def save(run_dir: Path, step: int, model, optimizer, scheduler, state: dict, keep: int) -> Path:
    """Write checkpoint `step`; on any failure remove the partial folder and keep the earlier ones."""
    import torch
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    try:
        tmp.mkdir()
        save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write (a full disk) as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        kept = ", ".join(p.name for p in checkpoints(run_dir)) or "none"
        raise FtError(
            f"saving checkpoint step {step} to {root} failed: {write_failure(e, root)}. The partial checkpoint was "
            "removed; earlier checkpoints "
            f"are intact ({kept}). Free space (or lower output.keep_checkpoints) and resume with --resume"
        ) from None
    for old in checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_failure(error: BaseException, where: Path) -> str:
    """Why a write failed, in words: a full disk is named as such (also when a library reports it as a RuntimeError)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    if (
        getattr(error, "errno", None) == errno.ENOSPC
        or "No space left" in str(error)
        or (free is not None and free < 64 * 2**20)
    ):
        return "the disk is full"
    return text[:300]


@contextlib.contextmanager
def atomic_folder(path: Path, what: str):
    """Write a folder whole or not at all: into a hidden sibling, renamed into place when complete (the old one, if
    any, is removed only then); on failure the partial folder is removed and an FtError says why."""
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    old = path.parent / f".old-{path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not path.exists():
            os.replace(old, path)
        raise FtError(
            f"saving {what} to {path} failed: {write_failure(e, path.parent)}. Nothing partial was left; the "
            "checkpoints "
            f"are intact. Free space, then resume with --resume (or write it from a checkpoint with ft consolidate)"
        ) from None
    shutil.rmtree(old, ignore_errors=True)


def save_sharded(run_dir: Path, step: int, engine, state: dict, keep: int, runtime) -> Path:
    """A sharded (FSDP, DeepSpeed) checkpoint: every rank writes its shards and RNG state into one temporary
    folder, rank 0 adds the rest and renames it into place once all ranks are done."""
    import torch

    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    runtime.barrier()
    try:
        engine.save_shards(tmp)
        torch.save(rng_state(), tmp / f"rng-{runtime.rank}.pt")
    except (OSError, RuntimeError) as e:
        raise FtError(
            f"saving sharded checkpoint step {step} failed on rank {runtime.rank}: {write_failure(e, root)}; "
            "earlier checkpoints are intact. "
            "Free space and resume with --resume"
        ) from None
    runtime.barrier()
    if runtime.is_main:
        torch.save(engine.scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step, "sharded": True}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    runtime.barrier()
    return final


def is_sharded(path: Path) -> bool:
    return (path / "dcp").is_dir() or (path / "deepspeed").is_dir()


def load(path: Path, engine, rank: int = 0) -> dict:
    """Restore a checkpoint into the engine's model, optimizer and scheduler; return its state."""
    import torch
    from safetensors.torch import load_file

    if is_sharded(path) != engine.sharded:
        raise FtError(
            f"checkpoint {path} was written by a {'sharded' if is_sharded(path) else 'single-copy'} backend and "
            "this job's backend is "
            f"{'sharded' if engine.sharded else 'not'}; resume with the distributed settings it was written with, "
            "or consolidate it first (ft consolidate)"
        )
    model, optimizer, scheduler = engine.inner, engine.optimizer, engine.scheduler
    if is_sharded(path):
        engine.load_shards(path)
        scheduler.load_state_dict(load_tensors(path / "scheduler.pt"))
        set_rng_state(load_tensors(path / f"rng-{rank}.pt"))
        return json.loads((path / "state.json").read_text())

    weights = load_file(str(path / "trainable.safetensors"))
    expected = set(trainable_state(model))
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:3], sorted(set(weights) - expected)[:3]
        raise FtError(
            f"checkpoint {path} does not match this model (missing {missing}, unexpected {extra}); was the "
            "config changed since it was written? Resume with the same config, or start a new output.dir"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    optimizer.load_state_dict(
        load_tensors(path / "optimizer.pt")
    )  # the optimizer casts its state to each parameter's device
    scheduler.load_state_dict(load_tensors(path / "scheduler.pt"))
    set_rng_state(load_tensors(path / "rng.pt"))
    return json.loads((path / "state.json").read_text())
