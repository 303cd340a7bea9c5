"""One rank of a job that `ft train` planned: from the run folder to the trained model, its records and report.

`python -m finetune.rank RUN_DIR [--resume-from CHECKPOINT]` starts a rank (plan/launch.py builds every
such command); a one-process job runs `train_run_folder` inside `ft train` itself. A rank reads config.yaml,
plan.json and data.json, never the job file, the CLI, the hardware probe or the planner. Around the loop of
`finetune.train` it adds what one process reports: the progress bar, trackers, the task metric before, during
and after training, the loss plot, the model card and result.json.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

STEP_HOOK = "FT_STEP_HOOK"  # test/debug hook: path/to/file.py:function, called as hook(rank, step) before each step


def main(argv: list[str] | None = None) -> None:
    """`python -m finetune.rank RUN_DIR [--resume-from CHECKPOINT]`: one rank of a job that `ft train` planned.

    The rank starts from the run folder alone (config.yaml, plan.json, data.json): it does not read the job
    file, probe the hardware, plan, or prepare data, and it does not import the CLI.

    Under torchrun the rank follows distributed/lifecycle.py: it stops on the first SIGTERM/SIGINT (or the
    launcher's stop request) after its step with a checkpoint, exits 0 then (torchrun reports no failure; the
    launcher says what happened, once), and stops when its parent dies."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m finetune.rank", description=main.__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run folder ft train wrote")
    parser.add_argument("--resume-from", default=None, help="a checkpoint folder of this run to continue from")
    args = parser.parse_args(argv)
    from finetune.errors import run_main
    from finetune.quiet import no_bars_in_logs, quiet_libraries

    no_bars_in_logs()
    quiet_libraries()

    run_main(
        lambda: _rank(Path(args.run_dir), args.resume_from),
        what=f"python -m finetune.rank {args.run_dir}",
        run_dir=args.run_dir,
    )


def _rank(run_dir: Path, resume_from: str | None) -> int:
    """Train; under a launcher, a stop becomes this rank's report to it (exit 0), a Ctrl-C its own message."""
    from finetune.distributed import lifecycle
    from finetune.distributed.runtime import failed_during, launched
    from finetune.errors import LostPeers, Stopped
    from finetune.runlock import joined, locked

    if not launched():  # one process started by hand: Stopped and Ctrl-C end it as they end ft train
        with locked(run_dir, f"python -m finetune.rank {run_dir}", make=False):  # the whole job, as ft train
            train_run_folder(run_dir, resume_from)
        return 0
    lifecycle.start_rank()
    try:
        with joined(run_dir):  # the lock its launcher shared: held while any rank of the job runs
            train_run_folder(run_dir, resume_from)
    except Stopped as e:
        return lifecycle.rank_stopped(str(e), e.exit_code - 128)
    except KeyboardInterrupt:
        return lifecycle.rank_interrupted(failed_during())
    except LostPeers as e:  # the launcher ends the job with its code: a scheduler may restart it
        lifecycle.report(lifecycle.LOST_PEERS, 0, message=str(e))
        raise
    except Exception:
        # failing, its error said next: the launcher's stop of the other ranks must not interrupt its exit
        lifecycle.ignore_stop_signals()
        raise
    return 0


def train_run_folder(run_dir, resume_from=None, prepared=None) -> dict:
    """One rank's whole job, from the run folder alone: the saved config, the Plan read back, the prepared data."""
    from finetune.artifacts import RunFolder
    from finetune.data.preprocess import load_prepared
    from finetune.distributed.runtime import explained_failures

    hooks = step_hooks()  # first: a hook that does not load fails before the model does
    folder = RunFolder(run_dir)
    run_dir = folder.path
    config, job_plan = folder.config(), folder.plan()
    if prepared is None:
        prepared = load_prepared(config, folder.prepared_cache())
    resume_from = Path(resume_from) if resume_from else None
    with explained_failures(config.distributed.timeout_minutes):
        return _train(config, job_plan, prepared, run_dir, resume_from, hooks)


def step_hooks() -> tuple:
    """The hook that FT_STEP_HOOK names (path/to/file.py:function or package.module:function), for tests and
    debugging: the loop calls it at the start of every step as hook(rank, step); it may raise (a failing rank),
    sleep (a rank that stops responding) or return True (stop after this step, as on SIGTERM). Read once, when the
    rank starts; none when the variable is unset."""
    spec = os.environ.get(STEP_HOOK)
    if not spec:
        return ()
    from finetune.userfn import load_function

    return (load_function(spec, STEP_HOOK),)


def _train(config, job_plan, prepared, run_dir, resume_from, hooks) -> dict:
    import json

    from rich.console import Console

    from finetune import checkpoint, train
    from finetune.artifacts import RunFolder
    from finetune.files import atomic_write_text
    from finetune.metrics import plot_losses
    from finetune.modelcard import model_card
    from finetune.progress import progress
    from finetune.trackers import Trackers

    console = Console(stderr=True, highlight=False)
    _quiet_loading(job_plan, console)
    job = train.setup(config, job_plan, prepared, deepspeed_config=RunFolder(run_dir).deepspeed_config())
    resume_from = checkpoint.agreed(run_dir, resume_from, job.runtime)
    is_main = job.runtime.is_main
    # the configured experiment trackers (none configured, or not rank 0: a no-op)
    run_name = config.output.run_name or run_dir.name
    trackers = Trackers(list(config.output.trackers), run_dir, run_name, config, rank=job.runtime.rank)
    processor = getattr(prepared, "processor", None)  # a vision-language model's (tokenizer, images, template)
    before = _task_eval(config, job, prepared.tokenizer, processor) if resume_from is None else None
    shown = config.method.progress_metrics
    with (
        progress(console, job.total_steps, config.output.log_steps, shown)
        if is_main
        else contextlib.nullcontext(lambda *a: None)
    ) as on_step:

        def after_step(step, total, row):
            on_step(step, total, row)
            if step % config.output.log_steps == 0:
                trackers.log(step, {k: v for k, v in row.items() if isinstance(v, (int, float))})
            _periodic_eval(config, job, prepared.tokenizer, run_dir, trackers, step, total, processor)

        try:
            result = train.run(job, run_dir, resume_from, on_step=after_step, hooks=hooks)
        except BaseException:
            trackers.close(failed=True)
            raise
    trackers.close()
    # a vision-language model's processor loads with the final model
    final = train.save_final(job, run_dir, processor or prepared.tokenizer)
    # before the return of other ranks: a sharded model generates on all
    after = _task_eval(config, job, prepared.tokenizer, processor)
    if not is_main:
        return result
    result.update(task_before=before, task_after=after, final=str(final), artifact=artifact_kind(job_plan))
    folder = RunFolder(run_dir)
    plot_losses(folder.metrics_path, folder.loss_plot_path, shown)
    card = {
        "config": config,
        "plan": job_plan.to_json(),
        "data": prepared.summary,
        "metrics": result,
        "artifact": result["artifact"],
        "run_dir": str(run_dir),
        "path": str(final),
        "name": run_name,
    }
    atomic_write_text(folder.card_path, model_card(card))
    atomic_write_text(folder.result_path, json.dumps(result, indent=2))
    _report(console, config, result)
    return result


def _task_eval(config, job, tokenizer, processor=None):
    if config.evaluation is None:
        return None
    from finetune.infer.evaluation import task_score
    from finetune.infer.prompts import template_for

    e = config.evaluation
    if not job.runtime.is_main and not job.engine.gathers_parameters:
        return None  # a sharded model generates on every rank (its forward needs them all); others: rank 0 alone
    from finetune.train import autocast

    @contextlib.contextmanager
    def context():
        with job.engine.generation(), autocast(job):
            yield

    return task_score(
        job.inner,
        tokenizer,
        template_for(tokenizer, config.data.template),
        e,
        job.device,
        context=context,
        synced=job.engine.synced_generation,
        processor=processor,
    )


def _periodic_eval(config, job, tokenizer, run_dir, trackers, step: int, total: int, processor=None) -> None:
    """evaluation.every_steps: the task metric during training, into metrics.jsonl and the trackers."""
    every = config.evaluation.every_steps if config.evaluation is not None else 0
    if not every or step % every or step >= total:
        return
    from finetune.artifacts import RunFolder
    from finetune.metrics import MetricsWriter

    score = _task_eval(config, job, tokenizer, processor)
    if score is not None and job.runtime.is_main:
        with MetricsWriter(RunFolder(run_dir).metrics_path) as metrics:
            metrics.log(step, **{f"eval_{config.evaluation.metric}": score})
        trackers.log(step, {f"eval_{config.evaluation.metric}": score})


def _quiet_loading(job_plan, console) -> None:
    """Before the model loads: no report of a score head that is new on purpose, no loading bars in a log."""
    from finetune.quiet import quiet_loading_bars, quiet_new_score_head

    if job_plan.head == "score":
        quiet_new_score_head()
    if not console.is_terminal:
        quiet_loading_bars()


def _report(console, config, result) -> None:
    line = f"trained {result['steps']} steps in {result['seconds']:.0f} s; final loss {result['final_loss']:.4f}"
    line += "".join(f", {name} {value:.4g}" for name, value in result.get("final_metrics", {}).items())
    if result.get("final_eval_loss") is not None:
        line += f", validation loss {result['final_eval_loss']:.4f}"
    console.print(line, soft_wrap=True)  # one line, whatever its length, for grep
    if result.get("task_after") is not None:
        e = config.evaluation
        from finetune.infer.scoring import score_text

        before = result.get("task_before")
        before = f"{score_text(e.metric, before, 1)} → " if before is not None else ""
        console.print(f"{e.metric} on {e.path}: {before}{score_text(e.metric, result['task_after'], 1)}")
    console.print(f"saved {result['artifact']} to {result['final']}")


def artifact_kind(plan) -> str:
    """What final/ holds: a reward model (merged where trained with an adapter), a whole model, or an adapter."""
    if plan.head == "score":
        return "reward model"
    return "model" if plan.adapter == "full" else "adapter"


if __name__ == "__main__":
    # Ended without the interpreter's teardown, as `ft` is: there, freeing the model frees the last holder of the
    # process group, whose gloo threads can need the GIL the freeing thread holds (a rank that never exits), or a
    # C++ thread is destroyed while joinable (SIGABRT after a finished run).
    from finetune.errors import exit_process

    exit_process(main)
