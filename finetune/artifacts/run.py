"""Run folders: the paths ft train writes, and their config and plan read back.

A run folder (output.dir) holds:
    config.yaml      the job as written (after --set and ${VAR}: secrets kept as ${VAR}, other values recorded)
    plan.json        the Plan every rank follows (its `exact` block rebuilds it field for field)
    data.json        where the prepared data set is cached
    checkpoints/     step-NNNNNNNN/ folders (see checkpoint.py; each backend owns what is inside)
    final/           the trained adapter (peft format) or model, with the tokenizer
    consolidated/    what `ft consolidate` wrote from a checkpoint
    export/          what is made from final/ for other tools: gguf-KIND/ (`ft export RUN --gguf --quant KIND`: the
                     GGUF file and an Ollama Modelfile), merged/ (the LoRA merged into its base that `ft push --merged`
                     writes and uploads)
    metrics.jsonl, loss.png, README.md (model card), environment.json, launch.txt
    rollout-server.log/.json, rollout-engine-N.log, rollout-engines.json  the vLLM servers ft train started for GRPO
                     (placement server; placement ray: one per Ray actor), their logs and, while they run, addresses
    .ft-run, .ft-lock  ft's marker, and the lock a job holds while it writes the folder (runlock.py)
    job.sbatch, slurm-*.out, job-k8s.yaml  what ft launch wrote and the scheduler's log (no run by themselves)
`RunFolder` names these paths and reads them back; every module that opens a run folder goes through it, and no other
module spells a name in it.

The folder's ownership is here too: the marker ft leaves in every folder it makes a run of, the checks before any
work, and `--overwrite`, which removes only what ft wrote there. ft never deletes a folder it cannot prove it made
(no marker), the folder the command runs in, or a folder that holds the job file; inside its own run folders it
removes only the entries it writes itself, leaving anything a person added. What `ft launch` and the scheduler leave
there (the script, Slurm's log of the job) holds no run yet: `ft train` starts in such a folder, and `--overwrite`
keeps those files. The lock (runlock.py) is `LOCK`: `ft train` takes it before it reads, removes or writes anything
there and holds it until its last rank has exited.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from finetune.errors import FtError

if TYPE_CHECKING:
    from finetune.config.schema import Config
    from finetune.plan.plan import Plan

MARKER = ".ft-run"
LOCK = ".ft-lock"  # held while a job writes the folder; says which process holds it (PID, host)
# What `ft launch` writes and Slurm adds before (and while) the job runs: no run yet, and kept by --overwrite (the
# running job's own Slurm log among them)
LAUNCH_FILES = ("job.sbatch", "job-k8s.yaml", "slurm-*.out")
# Every entry ft writes into a run folder (the trackers' folders included); anything else is not ft's to remove.
TRACKERS = ("tensorboard", "wandb", "mlflow.db", "mlruns", "mlartifacts")  # each tracker's files (trackers.py)
CHECKPOINT = re.compile(r"^step-(\d{8})$")  # checkpoints/step-NNNNNNNN
CHECKPOINT_STATE = "state.json"  # a checkpoint's record (checkpoint.py), written last: the checkpoint is complete
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
    "export",
    *TRACKERS,
    "nccl-traces",
    "rollout-server.log",
    "rollout-server.json",
    "rollout-engine-*.log",
    "rollout-engines.json",
    "ft-error-*.log",  # errors.py's traceback log (also written to the temporary folder, outside any run)
    ".tmp-final-*",
    ".old-final-*",
)


def _entry(name: str) -> property:
    return property(lambda self: self.path / name)


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder, and its config and plan read back."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path).expanduser())

    # The entries, each a path in the folder (the module docstring says what each holds)
    config_path = _entry("config.yaml")
    plan_path = _entry("plan.json")
    data_path = _entry("data.json")
    final = _entry("final")
    checkpoints_dir = _entry("checkpoints")
    metrics_path = _entry("metrics.jsonl")
    lock_path = _entry(LOCK)  # held while a job writes the folder (runlock.py); gone once the job has ended
    result_path = _entry("result.json")  # what the finished run reports: steps, final loss, where the weights are
    card_path = _entry("README.md")
    loss_plot_path = _entry("loss.png")
    environment_path = _entry("environment.json")
    launch_record_path = _entry("launch.txt")  # how the ranks were started
    deepspeed_path = _entry("deepspeed.json")
    resume_changes_path = _entry("resume-changes.jsonl")  # changes accepted by --allow-changes, a line per resume
    consolidated_dir = _entry("consolidated")
    export_dir = _entry("export")  # what is made from final/ for other tools (the module docstring)
    nccl_traces_dir = _entry("nccl-traces")
    rollout_log_path = _entry("rollout-server.log")  # the rollout server ft train started (rollout/pool.py)
    rollout_server_path = _entry("rollout-server.json")  # its address, while it runs (the ranks read it)
    rollout_engines_path = _entry("rollout-engines.json")  # placement ray: the servers' addresses, while they run
    sbatch_path = _entry("job.sbatch")
    k8s_path = _entry("job-k8s.yaml")

    def tracker_path(self, name: str) -> Path:
        """A tracker's own files (one of TRACKERS)."""
        if name not in TRACKERS:
            raise ValueError(f"{name!r} is not one of a run folder's tracker entries {TRACKERS}")
        return self.path / name

    def gguf_dir(self, kind: str) -> Path:
        """Where `ft export RUN --gguf --quant KIND` writes by default: the GGUF file and its Ollama Modelfile."""
        return self.export_dir / f"gguf-{kind}"

    @property
    def gguf_exports(self) -> list[Path]:
        """The folders `ft export --gguf` wrote, one per quantization kind (`ft push --gguf` uploads their files)."""
        return sorted(p for p in self.export_dir.glob("gguf-*") if p.is_dir()) if self.export_dir.is_dir() else []

    @property
    def merged_export(self) -> Path:
        """The LoRA adapter of final/ merged into its base, as `ft merge-lora` writes it (`ft push --merged`)."""
        return self.export_dir / "merged"

    def data_summary(self) -> dict:
        """What the prepared data held (sources, samples, tokens), as data.json records it; {} when absent."""
        summary = json_object(self.data_path).get("summary")
        return summary if isinstance(summary, dict) else {}

    def result(self) -> dict:
        """result.json: what the finished run reported (steps, losses, evaluations); {} when absent or damaged."""
        return json_object(self.result_path)

    def checkpoint(self, step: int) -> Path:
        """The folder checkpoint `step` is (or would be) written to."""
        return self.checkpoints_dir / f"step-{step:08d}"

    def checkpoint_staging(self, step: int) -> Path:
        """The hidden folder checkpoint `step` is written in before it is renamed into place."""
        return self.checkpoints_dir / f".tmp-step-{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (those with their state.json), oldest first."""
        root = self.checkpoints_dir
        if not root.is_dir():
            return []
        found = [p for p in root.iterdir() if CHECKPOINT.match(p.name) and complete(p)]
        return sorted(found, key=checkpoint_step)

    def is_run(self) -> bool:
        """Written by ft train: a config and a plan (older or partial folders may lack the marker)."""
        return self.config_path.is_file() and self.plan_path.is_file()

    def config(self) -> Config:
        """The run's config, validated as ft train validated it (`${VAR}` expanded from this environment)."""
        from finetune.config import load

        return load(self.config_path)

    def config_dict(self, unset_ok: tuple[tuple, ...] = ()) -> dict:
        """The run's config.yaml as a plain mapping, `${VAR}` expanded from this process's environment (for readers
        that need a few keys, also of runs whose config a newer ft would no longer validate). A reference to an unset
        variable is an FtError, except at the key paths `unset_ok` names: there it stays as written."""
        from finetune.config.env import Expansion

        expansion = Expansion(os.environ, yaml.safe_load)
        data = expansion.value(self.written_config())
        problems = [p for p in expansion.problems if not any(k in unset_ok for k in p.keys)]
        if problems:
            raise FtError(
                f"{self.config_path}: {problems[0].message}; set the variable the run was started with, or edit the "
                "file"
            )
        return data

    def written_config(self) -> dict:
        """The run's config.yaml as written: `${VAR}` references (secrets, or from runs of an older ft that recorded
        no values) not expanded."""
        path = self.config_path
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise FtError(f"{path}: cannot read the run's config: {e}") from None
        if not isinstance(data, dict):
            raise FtError(
                f"{path}: expected a job config (a mapping with model, adapter, ...), found {type(data).__name__}"
            )
        return data

    def rollout_server(self) -> str | None:
        """The address of the rollout server ft train started for this run, while it runs (None: it started none)."""
        path = self.rollout_server_path
        return json.loads(path.read_text())["url"] if path.is_file() else None

    def rollout_engine_log_path(self, index: int) -> Path:
        """The log of the vLLM server that Ray actor `index` started (placement ray: rollout/ray_run.py)."""
        return self.path / f"rollout-engine-{index}.log"

    def rollout_engines(self) -> list[str]:
        """The addresses of the vLLM servers ft train started on the Ray cluster, while they run ([]: none)."""
        path = self.rollout_engines_path
        return [e["url"] for e in json.loads(path.read_text())["engines"]] if path.is_file() else []

    def deepspeed_config(self) -> dict | None:
        """What the ranks pass to deepspeed.initialize, as ft train wrote it (None: DeepSpeed does not run)."""
        path = self.deepspeed_path
        return json.loads(path.read_text()) if path.is_file() else None

    def plan(self) -> Plan:
        """The Plan that `ft train` wrote (what every rank follows)."""
        from finetune.plan.plan import Plan

        path = self.plan_path
        try:
            return Plan.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise FtError(
                f"{path} does not exist: a rank starts from a run folder that ft train wrote; run ft train CONFIG"
            ) from None
        except (KeyError, TypeError, ValueError) as e:
            raise FtError(
                f"{path} is not a plan this version of ft wrote ({type(e).__name__}: {e}); run ft train CONFIG again "
                "to re-plan"
            ) from None

    def plan_dict(self) -> dict:
        """plan.json as a mapping; {} when it is missing or damaged (for readers that only refine what config.yaml
        says, such as the resolved adapter type of `adapter: auto`)."""
        return json_object(self.plan_path)

    def prepared_cache(self) -> Path:
        """The prepared data set's cache entry that ft train recorded in data.json."""
        try:
            return Path(json.loads(self.data_path.read_text())["cache"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FtError(
                f"{self.data_path}: cannot read where the prepared data is ({type(e).__name__}: {e}); "
                "run ft train CONFIG again"
            ) from None


def json_object(path: Path) -> dict:
    """The JSON object in `path`; {} when it is not a regular file, unreadable or holds something else."""
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def complete(checkpoint: Path) -> bool:
    """A checkpoint folder that holds its state.json: written whole."""
    return (Path(checkpoint) / CHECKPOINT_STATE).is_file()


def is_checkpoint(path: Path) -> bool:
    """`path` is a complete checkpoint in a run folder's checkpoints/."""
    path = Path(path).expanduser()
    return path.parent == RunFolder(path.parent.parent).checkpoints_dir and complete(path)


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoint folder (checkpoints/step-NNNNNNNN)."""
    match = CHECKPOINT.match(Path(path).name)
    if match is None:
        raise FtError(f"{path} is not a checkpoint folder of a run (checkpoints/step-NNNNNNNN)")
    return int(match.group(1))


# ---------------------------------------------------------------- ownership: marker, checks, --overwrite
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
    folder = RunFolder(run_dir)
    if folder.config_path.exists() or folder.checkpoints_dir.exists():
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
