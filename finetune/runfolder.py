"""A run folder's ownership: the marker ft leaves in every folder it makes a run of, the checks before any work,
and `--overwrite`, which removes only what ft wrote there.

ft never deletes a folder it cannot prove it made (no marker), the folder the command runs in, or a folder that
holds the job file; and inside its own run folders it removes only the entries it writes itself, leaving
anything a person added.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from finetune.errors import FtError

MARKER = ".ft-run"
# Every entry ft writes into a run folder (the trackers' folders included); anything else is not ft's to remove.
WRITTEN = (
    MARKER,
    "config.yaml",
    "plan.json",
    "data.json",
    "environment.json",
    "launch.txt",
    "deepspeed.json",
    "metrics.jsonl",
    "loss.png",
    "README.md",
    "result.json",
    "resume-changes.jsonl",
    "checkpoints",
    "final",
    "consolidated",
    "tensorboard",
    "wandb",
    "mlflow.db",
    "mlruns",
    "mlartifacts",
    "job.sbatch",
    "slurm-*.out",
    "ft-error-*.log",
    ".tmp-final-*",
    ".old-final-*",
)


def is_run(run_dir: Path) -> bool:
    """A folder ft made a run of (it holds the marker)."""
    return (run_dir / MARKER).is_file()


def looks_like_run(run_dir: Path) -> bool:
    """A folder holding what a run holds, with or without the marker (older versions of ft wrote none)."""
    return is_run(run_dir) or (run_dir / "config.yaml").exists() or (run_dir / "checkpoints").exists()


def check_output_dir(run_dir: Path) -> None:
    """Before any work: the output folder can be a run folder (not a file, writable, under a folder that exists or can
    be made)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise FtError(
            f"output.dir {run_dir} is a file, not a folder; choose a folder for the run (nothing was written)"
        )
    probe = run_dir if run_dir.exists() else next((p for p in run_dir.parents if p.exists()), Path("."))
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise FtError(
            f"output.dir {run_dir}: {probe} is not writable by this user; choose a folder you can write to "
            "(nothing was written)"
        )


def mark(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / MARKER
    if not marker.exists():
        marker.write_text(
            "This folder is an ft run folder: `ft train --overwrite` may remove the files ft wrote here.\n"
        )


def remove_run(run_dir: Path, job_file: Path | None) -> list[str]:
    """`--overwrite`: remove what ft wrote in `run_dir`; returns the entries left (not ft's). Refuses folders ft did not
    make."""
    here, target = Path.cwd().resolve(), run_dir.resolve()
    if target == here or target in here.parents:
        raise FtError(
            f"--overwrite: output.dir {run_dir} is the folder you run ft from (or holds it); ft will not delete "
            "it. Choose a dedicated output.dir"
        )
    if job_file is not None and target in Path(job_file).resolve().parents:
        raise FtError(
            f"--overwrite: output.dir {run_dir} holds the job file {job_file}; ft will not delete it. Choose a "
            "dedicated output.dir"
        )
    if not is_run(run_dir):
        present = sorted(p.name for p in run_dir.iterdir())[:8]
        raise FtError(
            f"--overwrite: {run_dir} was not made by this version of ft (no {MARKER} marker) and holds "
            f"{', '.join(present) or 'nothing'}; ft deletes only run folders it made. Delete it yourself if it is "
            "yours to lose, or choose another output.dir"
        )
    left = []
    for entry in run_dir.iterdir():
        if any(fnmatch.fnmatch(entry.name, pattern) for pattern in WRITTEN):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        else:
            left.append(entry.name)
    return sorted(left)
