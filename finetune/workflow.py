"""Glue between the CLI and the pure parts: load the config, get the hardware and the model facts, plan."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass

from finetune.errors import FtError, HardwareError, set_run_dir
from finetune.plan.plan import Plan


def hardware_for(description: str | None):
    """The hardware to plan for: described (`--hardware`) or probed from this machine."""
    from finetune.hardware import HardwareSpecError, parse, probe

    if description is None:
        return probe()
    try:
        return parse(description)
    except HardwareSpecError as e:
        raise HardwareError(f"--hardware: {e}") from None


def model_facts(model) -> object:
    """Architecture facts for the config's model section (local folder, catalog, or hub)."""
    from pathlib import Path

    from finetune.catalog import ModelNotFound, resolve

    if model.name.startswith((".", "/", "~")) and not Path(model.name).expanduser().exists():
        raise FtError(
            f"model.name: the folder {model.name} does not exist; point it at a folder with config.json and "
            "safetensors weights, a hub id, or ft-tiny"
        )
    try:
        return resolve(model.name, revision=model.revision, trust_remote_code=model.trust_remote_code)
    except ModelNotFound as e:
        raise FtError(str(e)) from None


def compile_plan(config_path: str | os.PathLike, overrides: Iterable[str] = (), hardware: str | None = None) -> Plan:
    """Config file -> Plan, raising FtError subclasses with user-facing messages."""
    from finetune.config import load
    from finetune.plan import plan

    config = load(config_path, overrides)
    hw = hardware_for(hardware)
    return plan(config, hw, model_facts(config.model), str(config_path))


def run_preprocess(
    config_path: str | os.PathLike, overrides: Iterable[str] = (), preview: int = 0, force: bool = False
):
    """`ft preprocess`: prepare (or reuse) the cached data with a progress bar, then summarise it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.data.preview import print_preview, print_summary

    config = load(config_path, overrides)
    console = Console(stderr=True, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        prepared = prepare(config, force=force, progress=progress)
    out = Console(highlight=False)
    out.print(f"{'built' if prepared.built else 'reused cached'} data: {prepared.path}")
    print_summary(prepared.summary, out)
    if preview:
        print_preview(prepared.train, prepared.tokenizer, preview, out)
    return prepared


@dataclass(frozen=True)
class NodeRole:
    """This node's place in a multi-node job (flags of `ft train`, or SLURM's variables)."""

    nnodes: int | None = None
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500

    @classmethod
    def from_env(cls, nnodes=None, node_rank=None, master_addr=None, master_port=None) -> NodeRole:
        from finetune.hardware import launch_env

        env = launch_env()
        slurm = env.launcher == "slurm"
        return cls(
            nnodes or (env.nnodes if slurm else None),
            node_rank if node_rank is not None else (env.node_rank if slurm else 0),
            master_addr or (env.master_addr if slurm else None),
            master_port or env.master_port or 29500,
        )


def run_train(
    config_path: str | os.PathLike,
    overrides: Iterable[str] = (),
    hardware: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    role: NodeRole | None = None,
    allow_changes: bool = False,
) -> dict:
    """`ft train`: plan once, prepare the data once per node, write the run folder, then start the ranks from it
    (in this process, or through torchrun). Ranks never see the job file, the CLI or the hardware probe."""
    import sys
    from pathlib import Path

    from finetune import checkpoint
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.distributed.launch import rank_command
    from finetune.plan import plan as make_plan

    role = role or NodeRole()
    config = load(config_path, overrides)
    hw = hardware_for(hardware)
    if role.nnodes and role.nnodes != hw.nodes:
        from finetune.plan.planner import with_hardware

        hw = with_hardware(hw, nodes=role.nnodes)
    facts = model_facts(config.model)
    job_plan = make_plan(config, hw, facts, str(config_path))
    run_dir = Path(config.output.dir).expanduser()
    if job_plan.nodes > 1 and role.master_addr is None:
        raise FtError(
            f"the plan spans {job_plan.nodes} nodes: run ft train on every node with --node-rank and "
            "--master-addr (the address of node 0), or under SLURM (ft launch --slurm writes the script)"
        )
    resuming = resume or config.output.resume == "auto"
    if role.node_rank == 0:  # node 0 owns the run folder; the other nodes only prepare their data and launch
        from finetune.runfolder import check_output_dir

        check_output_dir(run_dir)
        resume_from = _resume_point(run_dir, resuming, explicit=resume, overwrite=overwrite)
    else:
        resume_from = checkpoint.latest(run_dir) if resuming else None
    prepared = prepare(config)  # once per node, before any rank starts
    job_plan = _replan(config, hw, facts, config_path, prepared, job_plan)
    if role.node_rank == 0 and resuming and (run_dir / "config.yaml").exists():
        finished = _resume_checks(run_dir, config, job_plan, prepared, allow_changes)
        if finished is not None:
            return finished
    cmd = rank_command(
        str(run_dir),
        job_plan.nodes,
        job_plan.processes_per_node,
        job_plan.process_group,
        node_rank=role.node_rank,
        master_addr=role.master_addr,
        master_port=role.master_port,
        python=sys.executable,
        resume_from=str(resume_from) if resume_from else None,
    )
    if (
        role.node_rank == 0
    ):  # written before torchrun starts: no rank of any node runs before node 0's rendezvous, so all find it
        if overwrite and not resuming:
            _overwrite(run_dir, Path(config_path))  # only now: a job that fails to plan or prepare loses nothing
        _write_run_folder(run_dir, config, job_plan, prepared, cmd)
        set_run_dir(run_dir)  # from here on, an unexpected error's traceback goes into the run folder
    if job_plan.process_group:
        return _launch(cmd, job_plan, config_path, overrides)
    return train_run_folder(run_dir, resume_from, prepared)


def train_run_folder(run_dir, resume_from=None, prepared=None) -> dict:
    """One rank's whole job, from the run folder alone: the saved config, the Plan read back, the prepared data."""
    import json
    from pathlib import Path

    from finetune.config import load
    from finetune.data.preprocess import load_prepared

    run_dir = Path(run_dir)
    config, job_plan = load(run_dir / "config.yaml"), read_plan(run_dir)
    if prepared is None:
        prepared = load_prepared(config, Path(json.loads((run_dir / "data.json").read_text())["cache"]))
    return _train(config, job_plan, prepared, run_dir, Path(resume_from) if resume_from else None)


def read_plan(run_dir) -> Plan:
    """The Plan that `ft train` wrote into the run folder."""
    import json
    from pathlib import Path

    path = Path(run_dir) / "plan.json"
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


def _replan(config, hw, facts, config_path, prepared, job_plan):
    """Plan again when the data pipeline added tokens (the embeddings grow and are trained)."""
    if not prepared.added_tokens:
        return job_plan
    from finetune.plan import plan as make_plan

    return make_plan(
        config, hw, facts, str(config_path), new_tokens=len(prepared.added_tokens) - len(config.data.add_special_tokens)
    )


def _launch(cmd: list[str], job_plan, config_path, overrides) -> dict:
    """Start this node's ranks with torchrun and wait; a failing rank ends the job with its error, a stop signal
    with one message (see distributed/lifecycle.py)."""
    import shlex
    import sys

    from finetune.distributed.lifecycle import Exchange

    env = dict(os.environ)
    if "cpu" in job_plan.device.lower():
        env.setdefault("OMP_NUM_THREADS", "1")  # processes sharing cores each with several threads slow down badly
    line = " ".join(shlex.quote(a) for a in cmd)
    sys.stderr.write("launching: " + line + "\n")
    exchange = Exchange()
    try:
        code = _run_forwarding_signals(cmd, env, exchange)
        _raise_if_stopped(exchange, code, config_path, overrides)
    finally:
        exchange.close()
    if code < 0:  # torchrun itself was killed (its ranks get SIGTERM: they stop after their step and save a checkpoint)
        from finetune.distributed.lifecycle import signal_name

        raise FtError(
            f"training failed: torchrun, which runs the ranks, was killed by {signal_name(-code)}; the ranks stop "
            "after their "
            f"current step and save a checkpoint. Resume with: ft train CONFIG --resume"
        )
    if code:
        raise FtError(
            f"training failed: a rank exited with code {code} (its error is printed above). Re-run the same "
            f"command by hand with: {line}"
        )
    return {"steps": None, "launched": cmd}


def _run_forwarding_signals(cmd: list[str], env: dict, exchange=None) -> int:
    """Run torchrun in a session of its own that dies with ft, and pass on the SIGTERM/SIGINT ft receives.

    With an `exchange` (ft's training ranks): the first becomes a stop request that every rank turns into that
    signal, to stop after its step with a checkpoint; copies of it within a short window are ignored; a later
    one kills torchrun and the ranks at once. Without (other workers): each signal, less copies, goes to
    torchrun, which passes it to its workers."""
    import signal

    from finetune.distributed import lifecycle

    if exchange is not None:
        env = {**env, **exchange.env()}
    started = []  # torchrun, once started; a stop request made before that is read by the ranks when they start

    def forward(signum, frame):
        if lifecycle.note(signum) == "repeat":
            return
        if exchange is None:
            if not started:
                raise KeyboardInterrupt  # nothing started yet to pass it to: stop here
            started[0].send_signal(signum)
        elif not exchange.requested:
            exchange.request_stop(signum)
        elif not exchange.aborted and started:
            exchange.aborted = signum
            lifecycle.kill_now(started[0])

    lifecycle.reset_signals()
    old = {sig: signal.signal(sig, forward) for sig in lifecycle.STOP_SIGNALS}
    try:
        started.append(lifecycle.start_torchrun(cmd, env, ranks_stop_themselves=exchange is not None))
        return started[0].wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _raise_if_stopped(exchange, code: int, config_path, overrides) -> None:
    """The ranks stopped on a signal: say so once, from their reports, with the command that resumes. Reports
    count when ft asked for the stop or torchrun succeeded; else (torchrun stopping the peers of a failed rank)
    the failure is the news."""
    from pathlib import Path

    from finetune import checkpoint
    from finetune.config import load
    from finetune.distributed.lifecycle import signal_name, signal_number
    from finetune.train import Stopped

    reports = exchange.reports()
    if not exchange.aborted and not (reports and (code == 0 or exchange.requested)):
        return
    stopped = [r for r in reports if r.get("outcome") == "stopped"]
    if stopped:  # its checkpoint is complete (a second signal may have come while torchrun exited)
        raise Stopped(stopped[0]["message"], signal_number(stopped[0]["signal"]))
    last = checkpoint.latest(Path(load(config_path, overrides).output.dir))
    kept = (
        f"the newest checkpoint is {last}. Resume with: ft train CONFIG --resume"
        if last
        else "no checkpoint was written"
    )
    if exchange.aborted:
        raise Stopped(
            f"stopped at once by a second {signal_name(exchange.aborted)} (the work in progress is lost); {kept}",
            exchange.aborted,
        )
    signum = signal_number(reports[0]["signal"])
    during = next((r["during"] for r in reports if r.get("during") not in (None, "setting up")), "setup")
    raise Stopped(
        f"stopped by {signal_name(signum)} during {during}, with no step in progress to finish; {kept}", signum
    )


def _resume_point(run_dir, resume: bool, explicit: bool, overwrite: bool):
    """The checkpoint to resume from, or None; refuses to replace another run, or to write into a folder that is not
    a run, by accident. Reads only: `--overwrite` removes the old run later, once the new one has planned and
    prepared."""
    import sys

    from finetune import checkpoint
    from finetune.runfolder import looks_like_run

    holds_run = looks_like_run(run_dir)
    if not holds_run and run_dir.exists() and any(run_dir.iterdir()):
        raise FtError(
            f"output.dir {run_dir} is not empty and is not an ft run folder; choose an empty or new folder "
            "(nothing was written)"
        )
    if resume:
        last = checkpoint.latest(run_dir)
        if last is None and explicit:
            sys.stderr.write(f"--resume: {run_dir} has no complete checkpoint yet; starting from step 0\n")
        return last
    if holds_run and not overwrite:
        steps = [p.name for p in checkpoint.checkpoints(run_dir)]
        raise FtError(
            f"output.dir {run_dir} already holds a run "
            f"({', '.join(steps) or 'no checkpoints'}{', final model' if (run_dir / 'final').exists() else ''}); "
            "use --resume to continue it, --overwrite to replace it, or choose another output.dir"
        )
    return None


def _overwrite(run_dir, job_file) -> None:
    """--overwrite: remove what ft wrote in the old run (never a folder ft did not make); say what was left."""
    import sys

    from finetune.runfolder import remove_run

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


def _resume_checks(run_dir, config, job_plan, prepared, allow_changes: bool) -> dict | None:
    """Resuming an existing run: a finished run is left as it is (unless it is to train longer), and a changed config is
    refused with the list of changes, or accepted with --allow-changes and recorded in the run folder."""
    import json
    import sys
    import time

    import yaml

    from finetune.data.stream import steps_for
    from finetune.methods import rows_per_step
    from finetune.runlog import redact_config

    if (run_dir / "result.json").exists():
        done = json.loads((run_dir / "result.json").read_text()).get("steps") or 0
        total = steps_for(
            len(prepared.train),
            rows_per_step(config.method, job_plan.global_batch_size),
            config.train.max_steps,
            config.train.epochs,
        )
        if total <= done:
            sys.stderr.write(
                f"{run_dir} finished all {done} steps (final "
                f"{'model' if job_plan.adapter == 'full' else 'adapter'} in {run_dir / 'final'}); "
                "nothing to do. Raise train.max_steps to train further, or use --overwrite to start again\n"
            )
            return {"steps": done, "finished": True, "final": str(run_dir / "final")}
    changes = _config_changes(
        yaml.safe_load((run_dir / "config.yaml").read_text()) or {}, redact_config(config, exclude_unset=True)
    )
    unsafe = [c for c in changes if not c[0].startswith(RESUME_SAFE)]
    if unsafe and not allow_changes:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in unsafe[:10])
        raise FtError(
            f"--resume: the config differs from the run's ({run_dir / 'config.yaml'}) in {len(unsafe)} key(s) that "
            "change what is trained: "
            f"{listed}. Resume with the run's config, start a new output.dir, or pass --allow-changes to resume "
            "anyway (recorded in the run folder)"
        )
    if changes:
        with open(run_dir / "resume-changes.jsonl", "a", encoding="utf-8") as f:
            f.write(
                json.dumps(
                    {"time": round(time.time(), 3), "changes": [{"key": k, "was": a, "now": b} for k, a, b in changes]}
                )
                + "\n"
            )
    return None


def _config_changes(saved: dict, now: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, saved value, new value) for every key whose value differs (lists compared whole)."""
    out = []
    for key in sorted(set(saved) | set(now), key=str):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_changes(a, b, name + ".")
        elif a != b:
            out.append((name, a, b))
    return out


def _write_run_folder(run_dir, config, job_plan, prepared, cmd: list[str]) -> None:
    import json
    import shlex

    import yaml

    from finetune.runfolder import mark
    from finetune.runlog import atomic_write_text, environment_snapshot, redact_config

    mark(run_dir)  # first: from now on this folder is ft's run folder (and --overwrite may remove what ft writes here)
    # What the user wrote (after --set and ${VAR}), so that the file validates again as it is; plan.json has every
    # derived value.
    atomic_write_text(
        run_dir / "config.yaml", yaml.safe_dump(redact_config(config, exclude_unset=True), sort_keys=False)
    )
    atomic_write_text(run_dir / "plan.json", json.dumps(job_plan.to_json(), indent=2))
    atomic_write_text(run_dir / "environment.json", json.dumps(environment_snapshot(), indent=2, default=str))
    atomic_write_text(
        run_dir / "data.json",
        json.dumps(
            {"cache": str(prepared.path), "fingerprint": prepared.path.name, "summary": prepared.summary}, indent=2
        ),
    )
    how = "" if job_plan.process_group else "# run inside the ft train process; the same as running:\n"
    atomic_write_text(run_dir / "launch.txt", how + " ".join(shlex.quote(a) for a in cmd) + "\n")
    if job_plan.backend == "deepspeed":  # what the ranks pass to deepspeed.initialize, for the record and for re-use
        from finetune.distributed import deepspeed

        atomic_write_text(
            run_dir / deepspeed.FILE,
            json.dumps(deepspeed.config_for(job_plan, config.train, config.distributed), indent=2),
        )


def _train(config, job_plan, prepared, run_dir, resume_from) -> dict:
    from rich.console import Console

    from finetune.distributed.runtime import explained_failures

    console = Console(stderr=True, highlight=False)
    with explained_failures(config.distributed.timeout_minutes):
        return _train_explained(config, job_plan, prepared, run_dir, resume_from, console)


def _train_explained(config, job_plan, prepared, run_dir, resume_from, console) -> dict:
    import json

    from finetune import train
    from finetune.runlog import atomic_write_text, model_card, plot_losses

    job = train.setup(config, job_plan, prepared)
    main = job.runtime.is_main
    trackers = _trackers(config, run_dir, job.runtime.rank)
    before = _task_eval(config, job, prepared.tokenizer) if resume_from is None else None
    with _progress(console, job.total_steps) if main else contextlib.nullcontext(lambda *a: None) as on_step:

        def step_hook(step, total, row):
            on_step(step, total, row)
            if step % config.output.log_steps == 0:
                trackers.log(step, {k: v for k, v in row.items() if isinstance(v, (int, float))})
            _periodic_eval(config, job, prepared.tokenizer, run_dir, trackers, step, total)

        try:
            result = train.run(job, run_dir, resume_from, on_step=step_hook)
        except BaseException:
            trackers.close(failed=True)
            raise
    trackers.close()
    final = train.save_final(job, run_dir, prepared.tokenizer)
    after = _task_eval(
        config, job, prepared.tokenizer
    )  # before the return of other ranks: a sharded model generates on all
    if not main:
        return result
    result.update(
        {
            "task_before": before,
            "task_after": after,
            "final": str(final),
            "artifact": "model" if job_plan.adapter == "full" else "adapter",
        }
    )
    plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png")
    card = {
        "config": config,
        "plan": job_plan.to_json(),
        "data": prepared.summary,
        "metrics": result,
        "artifact": result["artifact"],
        "run_dir": str(run_dir),
        "path": str(final),
        "name": config.output.run_name or run_dir.name,
    }
    atomic_write_text(run_dir / "README.md", model_card(card))
    atomic_write_text(run_dir / "result.json", json.dumps(result, indent=2))
    _report(console, config, result)
    return result


def _trackers(config, run_dir, rank: int = 0):
    """The configured experiment trackers (none configured, or not rank 0: a no-op)."""
    from finetune.trackers import Trackers

    return Trackers(list(config.output.trackers), run_dir, config.output.run_name or run_dir.name, config, rank=rank)


def _task_eval(config, job, tokenizer):
    if config.evaluation is None:
        return None
    from finetune.evaluate import task_score
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
    )


def _periodic_eval(config, job, tokenizer, run_dir, trackers, step: int, total: int) -> None:
    """evaluation.every_steps: the task metric during training, into metrics.jsonl and the trackers."""
    every = config.evaluation.every_steps if config.evaluation is not None else 0
    if not every or step % every or step >= total:
        return
    from finetune.runlog import MetricsWriter

    score = _task_eval(config, job, tokenizer)
    if score is not None and job.runtime.is_main:
        with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
            metrics.log(step, **{f"eval_{config.evaluation.metric}": score})
        trackers.log(step, {f"eval_{config.evaluation.metric}": score})


@contextlib.contextmanager
def _progress(console, total: int):
    """A progress bar with loss, tokens/s and ETA; yields the per-step callback."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=total, loss=float("nan"), tps=0.0)
        yield lambda step, _total, row: bar.update(task, completed=step, loss=row["loss"], tps=row["tokens_per_s"])


def _report(console, config, result) -> None:
    line = f"trained {result['steps']} steps in {result['seconds']:.0f} s; final loss {result['final_loss']:.4f}"
    if result.get("final_eval_loss") is not None:
        line += f", validation loss {result['final_eval_loss']:.4f}"
    console.print(line)
    if result.get("task_after") is not None:
        e = config.evaluation
        before = f"{100 * result['task_before']:.1f}% → " if result.get("task_before") is not None else ""
        console.print(f"{e.metric} on {e.path}: {before}{100 * result['task_after']:.1f}%")
    console.print(f"saved {result['artifact']} to {result['final']}")


def write_launch_script(config_path, overrides, hardware, out, time_limit: str, partition: str | None):
    """`ft launch --slurm`: plan for the cluster's hardware and write the sbatch script."""
    from pathlib import Path

    from finetune.config import load
    from finetune.distributed.slurm import sbatch_script
    from finetune.runlog import atomic_write_text

    job_plan = compile_plan(config_path, overrides, hardware)
    config = load(config_path, overrides)
    out = Path(out) if out else Path(config.output.dir) / "job.sbatch"
    out.parent.mkdir(parents=True, exist_ok=True)
    name = config.output.run_name or Path(config.output.dir).name
    atomic_write_text(
        out,
        sbatch_script(
            str(config_path), job_plan, config.output.dir, f"ft-{name}", time_limit, partition, tuple(overrides)
        ),
    )
    out.chmod(0o755)
    return out
