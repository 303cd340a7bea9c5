"""Run folders: the paths ft train writes, and their config and plan read back.

A run folder (output.dir) holds:
    config.yaml      the job as written (after --set and ${VAR}: secrets kept as ${VAR}, other values recorded)
    plan.json        the Plan every rank follows (its `exact` block rebuilds it field for field)
    data.json        where the prepared data set is cached
    checkpoints/     step-NNNNNNNN/ folders (see checkpoint.py; each backend owns what is inside)
    final/           the trained adapter (peft format) or model, with the tokenizer
    consolidated/    what `ft consolidate` wrote from a checkpoint
    metrics.jsonl, loss.png, README.md (model card), environment.json, launch.txt
    .ft-run, .ft-lock  ft's marker, and the lock a job holds while it writes the folder (runfolder.py, runlock.py)
    job.sbatch, slurm-*.out, job-k8s.yaml  what ft launch wrote and the scheduler's log (no run by themselves)
`RunFolder` names these paths and reads them back; every module that opens a run folder goes through it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.errors import FtError

if TYPE_CHECKING:
    from finetune.config.schema import Config
    from finetune.plan.plan import Plan


@dataclass(frozen=True)
class RunFolder:
    """The paths of one run folder, and its config and plan read back."""

    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path).expanduser())

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def plan_path(self) -> Path:
        return self.path / "plan.json"

    @property
    def data_path(self) -> Path:
        return self.path / "data.json"

    @property
    def final(self) -> Path:
        return self.path / "final"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def lock_path(self) -> Path:
        """The lock a job holds while it writes the folder (runlock.py); gone once the job has ended."""
        from finetune.runfolder import LOCK

        return self.path / LOCK

    def checkpoint(self, step: int) -> Path:
        """The folder checkpoint `step` is (or would be) written to."""
        return self.checkpoints_dir / f"step-{step:08d}"

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
        import os

        import yaml

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
        import yaml

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
        try:
            plan = json.loads(self.plan_path.read_text()) if self.plan_path.is_file() else {}
        except (OSError, ValueError):
            return {}
        return plan if isinstance(plan, dict) else {}

    def prepared_cache(self) -> Path:
        """The prepared data set's cache entry that ft train recorded in data.json."""
        try:
            return Path(json.loads(self.data_path.read_text())["cache"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FtError(
                f"{self.data_path}: cannot read where the prepared data is ({type(e).__name__}: {e}); "
                "run ft train CONFIG again"
            ) from None
