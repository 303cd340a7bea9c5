"""A run folder's ownership: the marker ft leaves in every folder it makes a run of, the checks before any work,
`--overwrite`, which removes only what ft wrote there, and the lock a job holds while it writes the folder.

ft never deletes a folder it cannot prove it made (no marker), the folder the command runs in, or a folder that
holds the job file; and inside its own run folders it removes only the entries it writes itself, leaving
anything a person added. What `ft launch` and the scheduler leave there (the script, Slurm's log of the job) holds
no run yet: `ft train` starts in such a folder, and `--overwrite` keeps those files.

The lock (runlock.py) is `LOCK` in the run folder: `ft train` takes it before it reads, removes or writes anything
there and holds it until its last rank has exited.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from finetune.errors import FtError

MARKER = ".ft-run"
LOCK = ".ft-lock"  # held while a job writes the folder; says which process holds it (PID, host)
# What `ft launch` writes and Slurm adds before (and while) the job runs: no run yet, and kept by --overwrite (the
# running job's own Slurm log among them)
LAUNCH_FILES = ("job.sbatch", "job-k8s.yaml", "slurm-*.out")
# Every entry ft writes into a run folder (the trackers' folders included); anything else is not ft's to remove.
WRITTEN = (
    MARKER,
    LOCK,
    *LAUNCH_FILES,
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
    "nccl-traces",
    "ft-error-*.log",
    ".tmp-final-*",
    ".old-final-*",
)


def is_run(run_dir: Path) -> bool:
    """A folder ft made a run of (it holds the marker)."""
    return (run_dir / MARKER).is_file()


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


def holds_files(run_dir: Path) -> bool:
    """Anything in the folder besides ft's marker and lock and what a launch leaves there (LAUNCH_FILES)."""
    if not run_dir.is_dir():
        return False
    return any(not _matches(p.name, (MARKER, LOCK, *LAUNCH_FILES)) for p in run_dir.iterdir())


def looks_like_run(run_dir: Path) -> bool:
    """A folder holding what a run holds, with or without the marker (older versions of ft wrote none); a marked
    folder that holds only what `ft launch` and the scheduler left is no run yet."""
    if (run_dir / "config.yaml").exists() or (run_dir / "checkpoints").exists():
        return True
    return is_run(run_dir) and holds_files(run_dir)


def refuse_foreign(run_dir: Path) -> None:
    """ft writes a run only into a new or empty folder, one that holds an ft run, or one `ft launch` prepared."""
    if not looks_like_run(run_dir) and holds_files(run_dir):
        raise FtError(
            f"output.dir {run_dir} is not empty and is not an ft run folder; choose an empty or new folder "
            "(nothing was written)"
        )


def refuse_replacing_run(out: Path, flag: str) -> None:
    """A command that replaces its output folder whole (`ft merge-lora`, `ft consolidate` with --overwrite) never
    replaces a run folder (a live one would lose its checkpoints under the job; a finished one its history)."""
    if out.is_dir() and looks_like_run(out):
        raise FtError(
            f"{flag} {out} is an ft run folder; ft will not replace it with this command's output.\n    fix: write to "
            f"a new folder (e.g. {out / 'merged'})"
        )


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
    if not holds_files(run_dir):
        return []  # no run yet: only what ft launch and the scheduler left, which stays
    if not is_run(run_dir):
        present = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)[:8]
        raise FtError(
            f"--overwrite: {run_dir} was not made by this version of ft (no {MARKER} marker) and holds "
            f"{', '.join(present) or 'nothing'}; ft deletes only run folders it made. Delete it yourself if it is "
            "yours to lose, or choose another output.dir"
        )
    left = []
    for entry in run_dir.iterdir():
        if _matches(entry.name, (LOCK, *LAUNCH_FILES)):  # the lock this job holds; the script and the job's log
            continue
        if _matches(entry.name, WRITTEN):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        else:
            left.append(entry.name)
    return sorted(left)
