"""Checkpoints: written atomically by every rank, newest K kept, everything needed to resume exactly.

RUN/checkpoints/step-00000100/
    ...                     what the engine writes: its checkpoint format (distributed/engine.py `Engine.save`)
    scheduler.pt            the learning-rate schedule
    rng-<RANK>.pt           each rank's RNG state
    method-<RANK>.pt        what the method carries between steps, where it does (a GRPO rollout reused by the next
                            steps); tensors and plain data
    state.json              step, data position, tokens seen, the engine's `format`, ... (written last)
A checkpoint is written into a hidden temporary folder and renamed into place once every rank has written
its part, so a crash or a full disk mid-save never leaves a folder that looks complete, and older
checkpoints are deleted only after the new one is in place. This module knows nothing of what an engine
writes; the engine knows nothing of the folder's naming, completion or rotation.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

from finetune.artifacts.run import CHECKPOINT_STATE, RunFolder
from finetune.errors import FtError


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    return RunFolder(run_dir).checkpoints()


def latest(run_dir: Path) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def agreed(run_dir: Path, resume_from: Path | None, runtime) -> Path | None:
    """The checkpoint every rank resumes from: rank 0's. Nodes that start at different moments (a scheduler that
    replaces pods one by one) can find different newest checkpoints, one of them completed in between."""
    step = read_state(resume_from)["step"] if resume_from is not None else 0
    chosen = int(runtime.sum(step if runtime.is_main else 0))
    if chosen == step:
        return resume_from
    path = RunFolder(run_dir).checkpoint(chosen) if chosen else None
    sys.stderr.write(
        f"rank {runtime.rank} resumes from {path or 'the start'}, as rank 0 does (it found {resume_from})\n"
    )
    return path


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
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise FtError(
            f"checkpoint file {path} cannot be read safely ({first}): it holds something other than tensors and plain "
            "data, or it is damaged. ft loads checkpoints with weights_only=True and never runs code from them; "
            "resume from another checkpoint (delete this one) or start a new output.dir"
        ) from None


def save(run_dir: Path, step: int, engine, state: dict, keep: int, runtime, method=None) -> Path:
    """Write checkpoint `step`, called on every rank: rank 0 prepares a hidden folder, every rank writes its part
    (the engine's, and its RNG state), rank 0 adds the schedule and state.json and renames the folder into place,
    then deletes all but the newest `keep`. After each stage the ranks agree whether all succeeded: on any failure
    the partial folder is removed, the earlier checkpoints are kept, and every rank raises."""
    folder = RunFolder(run_dir)
    final, tmp = folder.checkpoint(step), folder.checkpoint_staging(step)
    main = runtime.is_main
    _stage(runtime, step, tmp, (lambda: _fresh(tmp)) if main else None)
    _stage(runtime, step, tmp, lambda: _write_rank_part(tmp, engine, runtime, method))
    _stage(runtime, step, tmp, (lambda: _complete(tmp, final, engine, state, step)) if main else None)
    if main:
        for old in checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _fresh(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier attempt at this step
    tmp.mkdir(parents=True)


def _write_rank_part(tmp: Path, engine, runtime, method=None) -> None:
    import torch

    engine.save(tmp, runtime)
    torch.save(rng_state(), tmp / f"rng-{runtime.rank}.pt")
    carried = method.state_dict() if hasattr(method, "state_dict") else None
    if carried:
        torch.save(carried, tmp / f"method-{runtime.rank}.pt")


def _complete(tmp: Path, final: Path, engine, state: dict, step: int) -> None:
    import torch

    torch.save(engine.scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / CHECKPOINT_STATE).write_text(json.dumps({**state, "step": step, "format": engine.format}, indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _stage(runtime, step: int, tmp: Path, work) -> None:
    """Run `work` on this rank (None: nothing to do here), then agree over all ranks whether every rank succeeded
    (each rank reaches the agreement whatever failed, so none waits for a peer that gave up)."""
    error = None
    if work is not None:
        try:
            work()
        except Exception as e:
            error = e
    if not runtime.any(error is not None):
        return
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None and not isinstance(error, (OSError, RuntimeError)):
        raise error  # not a failed write (torch.save reports one, a full disk, as a RuntimeError): a bug to show whole
    root = tmp.parent
    why = write_failure(error, root) if error is not None else "another rank failed to write its part (see its error)"
    kept = ", ".join(p.name for p in checkpoints(root.parent)) or "none"
    raise FtError(
        f"saving checkpoint step {step} to {root} failed on rank {runtime.rank}: {why}. The partial checkpoint was "
        f"removed; earlier checkpoints are intact ({kept}). Free space (or lower output.keep_checkpoints) and resume "
        "with --resume"
    ) from None


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
            "checkpoints are intact. Free space, then resume with --resume (or write it from a checkpoint with ft "
            "consolidate)"
        ) from None
    shutil.rmtree(old, ignore_errors=True)


def read_state(path: Path) -> dict:
    """A complete checkpoint's state.json."""
    try:
        state = json.loads((Path(path) / CHECKPOINT_STATE).read_text())
    except (OSError, ValueError) as e:
        raise FtError(
            f"checkpoint {path}: cannot read state.json ({type(e).__name__}: {e}); it is not a complete ft "
            "checkpoint: resume from another one (delete this one) or start a new output.dir"
        ) from None
    if not isinstance(state, dict):
        raise FtError(f"checkpoint {path}: state.json is not a mapping; resume from another checkpoint")
    return state


def written_format(path: Path) -> str:
    """The format of the engine that wrote checkpoint `path`, as recorded in its state.json."""
    fmt = read_state(path).get("format")
    if not isinstance(fmt, str):
        raise FtError(
            f"checkpoint {path}: state.json records no format (an earlier version of ft wrote it); resume or "
            "consolidate it with that version, or start a new output.dir"
        )
    return fmt


def load(path: Path, engine, runtime, method=None) -> dict:
    """Restore checkpoint `path` on every rank: the engine's part into its model and optimizer, then the schedule,
    this rank's RNG state and what the method carried; return the saved state. A checkpoint of another format
    (backend) is refused."""
    path = Path(path)
    state, written = read_state(path), written_format(path)
    if written == "single":  # no version of ft reads it now
        raise FtError(
            f"checkpoint {path} was written in the 'single' format of a development version of ft, which this version "
            "no longer reads (every torch backend now writes DCP checkpoints); resume it with the ft version that "
            "wrote it, or start the run again in a new output.dir (the checkpoint is left as it is)"
        )
    if written != engine.format:
        raise FtError(
            f"checkpoint {path} was written in the {written!r} format and this job's backend reads {engine.format!r}; "
            "resume with the distributed settings it was written with (distributed.backend and sharding, as in the "
            "run's plan.json), or consolidate it first (ft consolidate) and start a new run from those weights"
        )
    engine.load(path, runtime)
    engine.scheduler.load_state_dict(load_tensors(path / "scheduler.pt"))
    # this rank's RNG state; a rank the checkpoint's job did not have (more ranks now) starts from rank 0's
    rng = path / f"rng-{runtime.rank}.pt"
    set_rng_state(load_tensors(rng if rng.is_file() else path / "rng-0.pt"))
    carried = path / f"method-{runtime.rank}.pt"
    if hasattr(method, "load_state_dict"):
        method.load_state_dict(load_tensors(carried) if carried.is_file() else {})
    return state
