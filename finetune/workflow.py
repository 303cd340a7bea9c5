"""Glue between the CLI and the pure parts: load the config, get the hardware and the model facts, plan."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from finetune.artifacts.run import RunFolder, check_output_dir, mark, refuse_foreign
from finetune.config import load
from finetune.errors import ConfigError, FtError, HardwareError, LostPeers, Stopped, set_run_dir
from finetune.files import atomic_write_text
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

    from finetune.catalog import ModelNotFound
    from finetune.models import facts

    if model.name.startswith((".", "/", "~")) and not Path(model.name).expanduser().exists():
        raise FtError(
            f"model.name: the folder {model.name} does not exist; point it at a folder with config.json and "
            "safetensors weights, a hub id, or ft-tiny"
        )
    try:
        return facts(model)
    except ModelNotFound as e:
        raise FtError(str(e)) from None


def compile_plan(
    config_path: str | os.PathLike, overrides: Iterable[str] = (), hardware: str | None = None, config=None
) -> Plan:
    """Config file -> Plan, raising FtError subclasses with user-facing messages. `config`: the Config already loaded
    from `config_path` (with `overrides`), not parsed again. A run folder's config.yaml is planned as ft train planned
    it, for what its data.json says the prepared rows held (added tokens, images, trained share): the same plan as its
    plan.json."""

    config = config or load(config_path, overrides)
    folder = RunFolder(Path(config_path).parent)
    recorded = folder.data_summary() if Path(config_path).name == folder.config_path.name else {}
    return _plan_for_summary(config, hardware_for(hardware), model_facts(config.model), config_path, recorded)


def _plan_for_summary(config, hw, facts, config_path, summary: dict) -> Plan:
    """The plan for what a prepared data set's summary (data.preprocess; {} where none is known) tells the planner:
    the tokens the template adds beyond the config's own (the plan trains the grown embeddings), the most images a
    row holds where data.image.per_sample does not say, the largest share of a row's positions trained, and whether
    every row holds an image (plan.image_free_rows: DDP then needs no search for unused parameters)."""
    from finetune.plan import plan

    most = int(summary.get("max_images_per_row") or 0)
    images = most if config.data.image.per_sample is None and most > 0 else None
    new_tokens = len(summary.get("added_tokens") or ()) - len(config.data.add_special_tokens)  # the template's
    share = summary.get("most_trained_share")
    job_plan = plan(config, hw, facts, str(config_path), new_tokens, images_per_sample=images, trained_share=share)
    if job_plan.vision and summary.get("rows_without_images") == 0:
        job_plan = dataclasses.replace(job_plan, image_free_rows=False)
    return job_plan


def run_preprocess(
    config_path: str | os.PathLike, overrides: Iterable[str] = (), preview: int = 0, force: bool = False
):
    """`ft preprocess`: prepare (or reuse) the cached data with a progress bar, then summarise it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
    rdzv_id: str | None = None  # torchrun's c10d rendezvous with this id instead of a static one

    @classmethod
    def from_env(cls, nnodes=None, node_rank=None, master_addr=None, master_port=None, rdzv_id=None) -> NodeRole:
        from finetune.hardware import launch_env

        env = launch_env()
        slurm = env.launcher == "slurm"
        return cls(
            nnodes or (env.nnodes if slurm else None),
            node_rank if node_rank is not None else (env.node_rank if slurm else 0),
            master_addr or (env.master_addr if slurm else None),
            master_port or env.master_port or 29500,
            rdzv_id or None,
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
    """`ft train`: prepare the data once per node, plan once for it, write the run folder, then start the ranks from it
    (in this process, or through torchrun). Ranks never see the job file, the CLI or the hardware probe.

    Node 0 owns the run folder: it holds the folder's lock (runlock.py) from before it reads, removes or writes
    anything there until its last rank has exited; the other nodes only prepare their data and start their ranks,
    which join the lock."""
    from finetune.data.preprocess import prepare, training_tokenizer
    from finetune.launch.stopping import stopped_before_launch
    from finetune.plan.launch import launch_command
    from finetune.resume import overwrite_run, resume_checks
    from finetune.rollout.pool import rollout_pool
    from finetune.runlock import locked
    from finetune.vision import mixed_rows_problem

    role = role or NodeRole()
    with contextlib.ExitStack() as held:
        with stopped_before_launch():  # a signal while planning or preparing: stop, saying so
            config = load(config_path, overrides)
            facts = model_facts(config.model)  # a model that cannot be read is named before anything else
            tokens = training_tokenizer(config)  # the tokens a template adds: known before the data is read
            run_dir = Path(config.output.dir).expanduser()
            resuming = resume or config.output.resume == "auto"
            lock = None
            if role.node_rank == 0:  # node 0 owns the run folder
                check_output_dir(run_dir)
                lock = held.enter_context(locked(run_dir, f"ft train {config_path}"))  # before it is read
            resume_from = _resume_from(run_dir, role, resuming, resume, overwrite)
            prepared = prepare(config, tokens=tokens)  # once per node, before any rank starts
            job_plan = _plan_for_data(prepared, config, facts, hardware, role, config_path)  # once
            why = mixed_rows_problem(job_plan, prepared.train)  # what only the prepared rows tell about the plan
            if why is not None:
                raise FtError(f"data: {why}")
            if role.node_rank == 0 and resuming and RunFolder(run_dir).config_path.exists():
                finished = resume_checks(run_dir, config, job_plan, prepared, allow_changes)
                if finished is not None:
                    return finished
            cmd = launch_command(
                job_plan,
                str(run_dir),
                node_rank=role.node_rank,
                master_addr=role.master_addr,
                master_port=role.master_port,
                python=sys.executable,
                resume_from=str(resume_from) if resume_from else None,
                rdzv_id=role.rdzv_id,
            )
            # written before torchrun starts: no rank of any node runs before node 0's rendezvous, so all find it
            if role.node_rank == 0:
                if overwrite and not resuming:
                    overwrite_run(run_dir, Path(config_path))  # only now: a job that fails to plan loses nothing
                write_run_folder(run_dir, config, job_plan, prepared, cmd)
                set_run_dir(run_dir)  # from here on, an unexpected error's traceback goes into the run folder
        if on_ray(job_plan):  # ft train places and starts every rank and engine on the Ray cluster
            from finetune.rollout.ray_run import run_on_ray

            if lock is None:
                raise FtError(
                    "method.rollout.placement: ray: ft train runs once, on one machine of the Ray cluster, and starts "
                    "every rank there; run it without --node-rank"
                )
            lock.share()  # the ranks join it: held until the last of them exits
            return run_on_ray(config, job_plan, run_dir, resume_from)
        with rollout_pool(config, job_plan, run_dir) if role.node_rank == 0 else contextlib.nullcontext():
            if job_plan.process_group:
                if lock is not None:
                    lock.share()  # the ranks join it: held until the last of them exits
                owner = role.node_rank == 0
                return _launch(cmd, job_plan, run_dir, owner, role.master_addr)
            from finetune.rank import train_run_folder

            return train_run_folder(run_dir, resume_from, prepared)  # one process: this one is the rank


def on_ray(job_plan) -> bool:
    """The job runs as actors of a Ray cluster (method.rollout.placement: ray), not through torchrun."""
    return job_plan.rollout is not None and job_plan.rollout.placement == "ray"


def refuse_ray(job_plan, how: str) -> None:
    """`ft launch` writes a job that runs ft train on every node, through torchrun; a job on a Ray cluster runs ft train
    once, which places every rank itself."""
    if on_ray(job_plan):
        raise FtError(
            f"method.rollout.placement: ray: ft launch {how} writes a job that starts ft train on every node through "
            "torchrun, but a job on a Ray cluster runs ft train once, on one of its nodes, and places every rank "
            "there.\n    fix: start a Ray cluster on the nodes (ray start; KubeRay on Kubernetes) and run ft train on "
            "one of them, or set method.rollout.placement: auto"
        )


def _plan_for_data(prepared, config, facts, hardware, role: NodeRole, config_path):
    """The job's one plan on the nodes `role` says it has, made once the data is prepared and before the run folder is
    written, for what the prepared rows tell (`_plan_for_summary`: the tokens the template adds, the most images a
    row holds, more than data.image.per_sample says being an error naming it, the largest share of a row's positions
    trained, image-free rows). `ft plan` of the run folder's config.yaml reads the same summary from data.json."""
    most = int(prepared.summary.get("max_images_per_row") or 0)
    asked = config.data.image.per_sample
    if asked is not None and most > asked:
        raise FtError(
            f"data.image.per_sample: {asked}, but a prepared row holds {most} images; the plan would size memory for "
            f"fewer than the data has.\n    fix: set data.image.per_sample: {most}, or remove it (ft train then plans "
            "for the prepared rows' most)"
        )
    hw = hardware_for(hardware)
    if role.nnodes and role.nnodes != hw.nodes:  # the nodes this run was started on
        from finetune.plan.topology import with_hardware

        hw = with_hardware(hw, nodes=role.nnodes)
    job_plan = _plan_for_summary(config, hw, facts, config_path, prepared.summary)
    if job_plan.nodes > 1 and role.master_addr is None and not on_ray(job_plan):
        raise FtError(
            f"the plan spans {job_plan.nodes} nodes: run ft train on every node with --node-rank and "
            "--master-addr (the address of node 0), or under SLURM (ft launch --slurm writes the script)"
        )
    return job_plan


def _resume_from(run_dir, role: NodeRole, resuming: bool, resume: bool, overwrite: bool):
    """The checkpoint to resume from; node 0 also refuses a folder it must not write (it holds the lock by now)."""
    from finetune import checkpoint
    from finetune.resume import resume_point

    if role.node_rank == 0:
        return resume_point(run_dir, resuming, explicit=resume, overwrite=overwrite)
    return checkpoint.latest(run_dir) if resuming else None


def _launch(cmd: list[str], job_plan, run_dir, owner: bool = True, master_addr=None) -> dict:
    """Start this node's ranks with torchrun and wait; a failing rank ends the job with its error, a stop signal
    with one message (see distributed/lifecycle.py). `master_addr`: node 0's, where the job spans nodes."""
    from finetune.distributed.lifecycle import ENV_STOP_SECONDS, LOST_PEERS
    from finetune.distributed.runtime import nccl_environment
    from finetune.launch.netif import gloo_environment
    from finetune.launch.stopping import Exchange, run_forwarding_signals

    env = dict(os.environ)
    env.update(gloo_environment(master_addr, job_plan.nodes))  # across nodes: the interface ft's gloo collectives use
    if "cpu" in job_plan.device.lower():
        env.setdefault("OMP_NUM_THREADS", "1")  # processes sharing cores each with several threads slow down badly
    else:  # before any rank exists: torch reads them when the NCCL group starts
        env.update(nccl_environment(run_dir))
        if owner:  # node 0, before its torchrun: before any rank of any node runs (only node 0 makes the folder)
            RunFolder(run_dir).nccl_traces_dir.mkdir(exist_ok=True)
    if job_plan.stop_seconds:  # a stop's checkpoint may take this long: torchrun's shutdown, an orphan's grace
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(job_plan.stop_seconds))
        env[ENV_STOP_SECONDS] = str(job_plan.stop_seconds)
    line = " ".join(shlex.quote(a) for a in cmd)
    sys.stderr.write("launching: " + line + "\n")
    exchange = Exchange()
    try:
        code = run_forwarding_signals(cmd, env, exchange)
        _raise_if_stopped(exchange, code, run_dir)
        lost = [r for r in exchange.reports() if r.get("outcome") == LOST_PEERS] if code else []
        # every rank here lost its peers (one that failed by itself is the news): a node preempted or dead, another
        # attempt may succeed (a retryable exit code)
        if lost and len(lost) >= job_plan.processes_per_node:
            raise LostPeers(f"training failed: {lost[0].get('message')}. Resume with: ft train CONFIG --resume")
    finally:
        exchange.close()
    if code < 0:  # torchrun itself was killed (its ranks get SIGTERM: they stop after their step and save a checkpoint)
        from finetune.distributed.lifecycle import signal_name

        raise FtError(
            f"training failed: torchrun, which runs the ranks, was killed by {signal_name(-code)}; the ranks stop "
            f"after their current step and save a checkpoint. Resume with: ft train CONFIG --resume"
        )
    if code:
        raise FtError(
            f"training failed: a rank exited with code {code} (its error is printed above). Re-run the same "
            f"command by hand with: {line}"
        )
    return {"steps": None, "launched": cmd}


def _raise_if_stopped(exchange, code: int, run_dir) -> None:
    """The ranks stopped on a signal: say so once, from their reports, with the command that resumes. Reports
    count when ft asked for the stop or torchrun succeeded; else (torchrun stopping the peers of a failed rank)
    the failure is the news."""
    from finetune import checkpoint
    from finetune.distributed.lifecycle import signal_name, signal_number

    reports = exchange.reports()
    if not exchange.aborted and not (reports and (code == 0 or exchange.requested)):
        return
    stopped = [r for r in reports if r.get("outcome") == "stopped"]
    if stopped:  # its checkpoint is complete (a second signal may have come while torchrun exited)
        raise Stopped(stopped[0]["message"], signal_number(stopped[0]["signal"]))
    last = checkpoint.latest(run_dir)
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


def write_run_folder(run_dir, config, job_plan, prepared, cmd: list[str]) -> None:
    import yaml

    from finetune.redaction import redact_config
    from finetune.runinfo import environment_snapshot

    folder = RunFolder(run_dir)
    mark(run_dir)  # first: from now on this folder is ft's run folder (and --overwrite may remove what ft writes here)
    # What the user wrote (after --set and ${VAR}), so that the file validates again as it is; plan.json has every
    # derived value.
    atomic_write_text(folder.config_path, yaml.safe_dump(redact_config(config, exclude_unset=True), sort_keys=False))
    atomic_write_text(folder.plan_path, json.dumps(job_plan.to_json(), indent=2))
    atomic_write_text(folder.environment_path, json.dumps(environment_snapshot(), indent=2, default=str))
    atomic_write_text(
        folder.data_path,
        json.dumps(
            {"cache": str(prepared.path), "fingerprint": prepared.path.name, "summary": prepared.summary}, indent=2
        ),
    )
    how = "" if job_plan.process_group else "# run inside the ft train process; the same as running:\n"
    atomic_write_text(folder.launch_record_path, how + " ".join(shlex.quote(a) for a in cmd) + "\n")
    if job_plan.backend == "deepspeed":  # what the ranks pass to deepspeed.initialize, for the record and for re-use
        from finetune.distributed import deepspeed

        atomic_write_text(
            folder.deepspeed_path,
            json.dumps(deepspeed.config_for(job_plan, config.train, config.distributed), indent=2),
        )


def check_job(config_path, overrides: Iterable[str] = ()):
    """`ft validate`'s checks: the job file (every problem, with file and line) and its local data paths. Returns the
    Config; `ft launch` runs them too, so it never writes a job that `ft validate` refuses."""
    from finetune.data.sources import check_paths

    config = load(config_path, overrides)
    rollout = getattr(config.method, "rollout", None)
    if rollout is not None and rollout.placement == "ray":
        from finetune.plan.rollout import RAY_MISSING, ray_installed

        if not ray_installed():
            raise FtError(f"{config_path}: {RAY_MISSING}")
    problems = check_paths(config)
    if problems:
        raise FtError(
            f"{config_path}: {len(problems)} data path problem{'s' if len(problems) != 1 else ''}\n"
            + "\n".join("  ✗ " + p.replace("\n", "\n  ") for p in problems)
        )
    _check_model_rules(config, str(config_path))
    return config


def _check_model_rules(config, config_path: str) -> None:
    """The rules that need the model's facts (finetune/config/moe_checks.py), where they are known without the hub
    (a local folder or a catalog name); ft plan runs them for every model."""

    from finetune.catalog import lookup
    from finetune.config.moe_checks import moe_problems
    from finetune.config.vision_checks import vision_problems

    local = (Path(config.model.name).expanduser() / "config.json").is_file()
    if not local and lookup(config.model.name) is None:
        return
    facts = model_facts(config.model)
    problems = moe_problems(config, facts) + vision_problems(config, facts)
    if problems:
        raise ConfigError(config_path, problems)


def write_launch_script(config_path, overrides, hardware, out, time_limit: str, partition: str | None):
    """`ft launch --slurm`: check the job as `ft validate` does, plan for the cluster's hardware and write the sbatch
    script. The run folder, where Slurm writes the job's log (sbatch does not make that folder), exists afterwards."""

    from finetune.launch.slurm import sbatch_script

    config = check_job(config_path, overrides)
    run_dir = Path(config.output.dir).expanduser()
    check_output_dir(run_dir)
    refuse_foreign(run_dir)  # what ft train would refuse on the cluster, said now
    job_plan = compile_plan(config_path, overrides, hardware, config)
    refuse_ray(job_plan, "--slurm")
    out = Path(out) if out else RunFolder(run_dir).sbatch_path
    name = config.output.run_name or run_dir.name
    text = sbatch_script(
        str(config_path), job_plan, str(run_dir), f"ft-{name}", time_limit, partition, tuple(overrides)
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    out.chmod(0o755)
    return out


def write_generate_script(
    args: list[str], output: str, hardware: str | None, out, time_limit: str, partition: str | None
):
    """`ft launch generate --slurm -- ARGS`: the sbatch script that runs `ft generate ARGS` (checked by the CLI; its
    --out is `output`) on the nodes of `hardware` (one, or several sharing a filesystem)."""

    from finetune.launch.slurm import Allocation, generate_script
    from finetune.plan.stopping import MIN_STOP_S

    if not hardware:
        raise FtError("ft launch generate needs --hardware: the cluster's nodes and devices, e.g. 8xH100 or 2x8xH100")
    node = hardware_for(hardware)
    log_dir = Path(output).expanduser().absolute().parent  # Slurm writes the log there: made now (sbatch does not)
    out = Path(out) if out else log_dir / "generate.sbatch"
    gpus = 0 if node.is_cpu else node.devices_per_node
    allocation = Allocation(
        "ft-generate", node.nodes, gpus, node.cpu_cores, MIN_STOP_S, time_limit, partition, str(log_dir), os.getcwd()
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, generate_script(list(args), allocation))
    out.chmod(0o755)
    return out
