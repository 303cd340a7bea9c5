"""Starting `ft train` over an output folder that already holds a run: where to resume from, what `--overwrite`
removes, and which config changes a resume accepts (the rest are refused, or recorded with --allow-changes)."""

from __future__ import annotations

import json
import sys
import time

from finetune.artifacts.run import RunFolder
from finetune.errors import FtError


def resume_point(run_dir, resume: bool, explicit: bool, overwrite: bool):
    """The checkpoint to resume from, or None; refuses to replace another run, or to write into a folder that is not
    a run, by accident. Reads only: `--overwrite` removes the old run later, once the new one has planned and
    prepared."""
    from finetune import checkpoint
    from finetune.artifacts.run import looks_like_run, refuse_foreign

    refuse_foreign(run_dir)
    holds_run = looks_like_run(run_dir)
    if resume:
        last = checkpoint.latest(run_dir)
        if last is None and explicit:
            sys.stderr.write(f"--resume: {run_dir} has no complete checkpoint yet; starting from step 0\n")
        return last
    if holds_run and not overwrite:
        steps = [p.name for p in checkpoint.checkpoints(run_dir)]
        raise FtError(
            f"output.dir {run_dir} already holds a run "
            f"({', '.join(steps) or 'no checkpoints'}{', final model' if RunFolder(run_dir).final.exists() else ''}); "
            "use --resume to continue it, --overwrite to replace it, or choose another output.dir"
        )
    return None


def overwrite_run(run_dir, job_file) -> None:
    """--overwrite: remove what ft wrote in the old run (never a folder ft did not make); say what was left."""
    from finetune.artifacts.run import remove_run

    if not run_dir.exists():
        return
    left = remove_run(run_dir, job_file)
    if left:
        sys.stderr.write(
            f"--overwrite: removed the old run; kept {len(left)} entries ft did not write: {', '.join(left[:8])}\n"
        )


# Keys a resumed run may change: they do not change what is trained or how (only how long, and what is logged or kept).
RESUME_SAFE = (
    "train.max_steps",
    "train.epochs",
    "output.log_steps",
    "output.save_steps",
    "output.eval_steps",
    "output.keep_checkpoints",
    "output.trackers",
    "output.resume",
    "output.run_name",
    "distributed.timeout_minutes",
    "evaluation.every_steps",
)


def resume_checks(run_dir, config, job_plan, prepared, allow_changes: bool) -> dict | None:
    """Resuming an existing run: a finished run is left as it is (unless it is to train longer), and a changed config is
    refused with the list of changes, or accepted with --allow-changes and recorded in the run folder."""
    from finetune.data.stream import steps_for
    from finetune.redaction import redact_config

    folder = RunFolder(run_dir)
    if folder.result_path.exists():
        done = json.loads(folder.result_path.read_text()).get("steps") or 0
        total = steps_for(
            len(prepared.train),
            config.method.rows_per_step(job_plan.global_batch_size),
            config.train.max_steps,
            config.train.epochs,
            config.method.steps_per_batch(),
        )
        if total <= done:
            sys.stderr.write(
                f"{run_dir} finished all {done} steps (final "
                f"{'model' if job_plan.adapter == 'full' else 'adapter'} in {folder.final}); "
                "nothing to do. Raise train.max_steps to train further, or use --overwrite to start again\n"
            )
            return {"steps": done, "finished": True, "final": str(folder.final)}
    saved = folder.written_config()
    changes = config_changes(saved, redact_config(config, exclude_unset=True))
    if changes:  # a run folder of an older ft holds every value from the environment as its ${VAR}: compare as written
        as_written = {
            c[0] for c in config_changes(saved, redact_config(config, exclude_unset=True, as_references=True))
        }
        changes = [c for c in changes if c[0] in as_written]
    unsafe = [c for c in changes if not c[0].startswith(RESUME_SAFE)]
    if unsafe and not allow_changes:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in unsafe[:10])
        raise FtError(
            f"--resume: the config differs from the run's ({folder.config_path}) in {len(unsafe)} key(s) that "
            f"change what is trained: {listed}. Resume with the run's config, start a new output.dir, or pass "
            "--allow-changes to resume anyway (recorded in the run folder)"
        )
    if changes:
        record = {"time": round(time.time(), 3), "changes": [{"key": k, "was": a, "now": b} for k, a, b in changes]}
        with open(folder.resume_changes_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return None


def config_changes(saved: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) for every key whose value differs (lists compared whole)."""
    out = []
    for key in sorted(set(saved) | set(now), key=str):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, name + ".")
        elif a != b:
            out.append((name, a, b))
    return out
