"""sbatch scripts that run ft on a Slurm cluster: `ft train` or `ft generate` (one per node, torchrun inside).

What a shared cluster needs, and where the script does it:
- Whole nodes: `--exclusive`, `--mem=0` (all of the node's memory) and `--cpus-per-task` (the node's cores for the
  one task per node, which starts every rank of the node and tokenises); srun does not inherit `--cpus-per-task`
  from sbatch (Slurm >= 22.05), so the script passes it on.
- The rendezvous port comes from the job id, so two jobs that share a node do not collide (FT_MASTER_PORT sets
  another); a MASTER_PORT/MASTER_ADDR exported where sbatch ran (sbatch passes the environment on) is not used.
- NCCL/torch variables are exported before srun: every process, hence every process group, starts with them.
  gloo's network interface is chosen by each node's `ft train` (launch/netif.py: the route to MASTER_ADDR),
  unless GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME is exported where sbatch runs (sbatch passes it on).
- Time limits: Slurm signals the batch shell (`--signal=B:USR1@N`) N seconds ahead, N from the plan's estimate of
  the time to finish a step and write a checkpoint. The shell passes USR1 on once, through srun, to the task of
  every node; ft stops after its step with a checkpoint (exit 128+USR1), and the shell runs `scontrol requeue`:
  the job starts again later and resumes from that checkpoint (output.resume=auto). A SIGTERM (preemption,
  scancel) also stops the ranks after their step with a checkpoint; the shell waits for them.
- The job's log (`--output`): sbatch opens it before the script runs and does not make its folder, so the path is
  absolute and `ft launch` makes the folder (the run folder, or the folder of ft generate's output).
- Secrets stay in the environment the job is submitted from; the script holds none.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from finetune.distributed.runtime import NCCL_ENV
from finetune.plan.plan import Plan

PORT_BASE, PORT_SPAN = 15000, 15000  # rendezvous ports 15000-29999: below Linux's ephemeral range (32768-)
USR1 = 10  # signal number of SIGUSR1 on Linux


@dataclass(frozen=True)
class Allocation:
    """What the job asks Slurm for."""

    job_name: str
    nodes: int
    gpus_per_node: int  # 0: a CPU job
    cpus_per_node: int
    stop_seconds: int  # warning before the time limit: finish the step, write the checkpoint
    time_limit: str
    partition: str | None
    log_dir: str  # absolute: Slurm opens the job's log there before the script runs, and never makes the folder
    workdir: str  # where relative paths (the job file, its data, output.dir) resolve: where ft launch ran


def sbatch_script(
    config_path: str,
    plan: Plan,
    run_dir: str,
    job_name: str,
    time_limit: str = "24:00:00",
    partition: str | None = None,
    overrides: tuple[str, ...] = (),
) -> str:
    """The script of a training job: one `ft train` per node, resumed by a requeued job."""
    sets = " ".join(f"--set {shlex.quote(o)}" for o in (*overrides, "output.resume=auto"))
    # run by each node's task, which expands its own SLURM_NODEID (the batch shell runs on node 0); one task per
    # node, so its task rank is its node's rank where a Slurm sets no SLURM_NODEID
    command = (
        f'exec ft train {shlex.quote(config_path)} {sets} --nnodes "${{SLURM_NNODES:-{plan.nodes}}}" '
        '--node-rank "${SLURM_NODEID:-$SLURM_PROCID}" '
        f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" ${{FT_TRAIN_ARGS:-}}'
    )
    allocation = Allocation(
        job_name,
        plan.nodes,
        0 if "CPU" in plan.device else plan.processes_per_node,
        plan.cpus_per_node,
        plan.stop_seconds,
        time_limit,
        partition,
        os.path.abspath(os.path.expanduser(run_dir)),  # the log's folder, as sbatch opens it (no ~ there)
        os.getcwd(),
    )
    about = (
        f"`ft train` for {plan.model} ({plan.method}, {plan.adapter}, {plan.backend}); plan: {plan.nodes} node(s) x "
        f"{plan.processes_per_node} process(es), {plan.checkpoint_bytes / 2**30:.1f} GiB per node per checkpoint"
    )
    return _script(allocation, about, command, forward="USR1", stopped_code=128 + USR1)


def generate_script(args: list[str], allocation: Allocation) -> str:
    """The script of `ft generate ARGS` on the allocation's nodes (each node's task runs it with its node rank, as for
    training); a requeued job continues where it stopped (its rows are kept)."""
    command = "exec ft generate " + " ".join(shlex.quote(a) for a in args)
    if allocation.nodes > 1:
        command += (
            f' --nnodes "${{SLURM_NNODES:-{allocation.nodes}}}" --node-rank "${{SLURM_NODEID:-$SLURM_PROCID}}" '
            '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"'
        )
    where = f"{allocation.nodes} nodes" if allocation.nodes > 1 else "one node"
    about = f"`ft generate` on {where} with {allocation.gpus_per_node or 'no'} GPU(s) each"
    # ft generate's workers stop on SIGTERM (torchrun passes it on); the finished batches stay in OUT.parts
    return _script(allocation, about, command, forward="TERM", stopped_code=None)


def port_expression() -> str:
    """Shell arithmetic for the rendezvous port: the same on every node of a job, different for the next job."""
    return f"$(( {PORT_BASE} + ${{SLURM_JOB_ID:-0}} % {PORT_SPAN} ))"


def _header(a: Allocation) -> str:
    lines = [
        f"--job-name={a.job_name}",
        f"--chdir={_quoted(a.workdir)}",
        f"--nodes={a.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={a.gpus_per_node}"] if a.gpus_per_node else []),
        f"--cpus-per-task={a.cpus_per_node}",
        "--mem=0",
        "--exclusive",
        *([f"--partition={a.partition}"] if a.partition else []),
        f"--time={a.time_limit}",
        f"--output={_quoted(a.log_dir.replace('%', '%%') + '/slurm-%j.out')}",  # %%: a '%' of the path itself
        "--open-mode=append",
        f"--signal=B:USR1@{a.stop_seconds}",
        "--requeue",
    ]
    return "\n".join(f"#SBATCH {line}" for line in lines)


def _quoted(value: str) -> str:
    """An #SBATCH option's value: sbatch splits those lines at blanks, except inside double quotes."""
    if not any(c.isspace() or c == '"' for c in value):
        return value
    escaped = value.replace('"', '\\"')
    return f'"{escaped}"'


def _script(a: Allocation, about: str, command: str, forward: str, stopped_code: int | None) -> str:
    """The batch script: environment, srun in the background, USR1 passed on once, requeue after a clean stop."""
    nccl = "\n".join(f'export {k}="${{{k}:-{v}}}"' for k, v in NCCL_ENV)
    stopped = f'[ "$rc" = {stopped_code} ]' if stopped_code is not None else '[ "$rc" != 0 ]'
    return f"""#!/bin/bash
# Written by `ft launch --slurm`: {about}.
# Ahead of the time limit Slurm sends USR1 to this script ({a.stop_seconds} s: the plan's time to finish a step and
# write a checkpoint); the script passes it once to every node, ft stops with a checkpoint, and the job is requeued
# (scontrol requeue) to continue from it. Extra flags for each node's command: FT_TRAIN_ARGS (e.g. --hardware ...).
{_header(a)}
set -uo pipefail
mkdir -p {shlex.quote(a.log_dir)}
export MASTER_ADDR="$(scontrol show hostnames "${{SLURM_JOB_NODELIST:-}}" | head -n 1)"
# from the job id, so jobs sharing a node never collide (a MASTER_PORT exported where sbatch ran is not used)
export MASTER_PORT="${{FT_MASTER_PORT:-{port_expression()}}}"
# Read when each rank's process group starts, so exported before any process exists:
{nccl}
export SRUN_CPUS_PER_TASK="${{SLURM_CPUS_PER_TASK:-{a.cpus_per_node}}}"  # srun does not inherit --cpus-per-task
# Hub tokens and tracker keys come from the environment (HF_TOKEN, WANDB_API_KEY); never write them here.

warned=0
on_warning() {{  # Slurm's USR1 ahead of the time limit: pass it on once
  if [ "$warned" = 0 ]; then
    warned=1
    echo "ft: the time limit is near: every node stops after its step with a checkpoint, then the job is requeued" >&2
    kill -{forward} "$step" 2>/dev/null || true
  fi
}}
trap on_warning USR1
trap 'echo "ft: SIGTERM: waiting for the nodes to save their checkpoint" >&2' TERM
srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c {shlex.quote(command)} &
step=$!
while :; do
  wait "$step"; rc=$?
  if [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null; then continue; fi  # a trap ran; srun goes on
  break
done
if [ "$rc" -gt 128 ]; then wait "$step" 2>/dev/null; last=$?; [ "$last" != 127 ] && rc=$last; fi
if [ "$warned" = 1 ] && {stopped}; then
  echo "ft: requeueing job ${{SLURM_JOB_ID:-}}: it continues from where it stopped" >&2
  scontrol requeue "${{SLURM_JOB_ID:-}}"
fi
exit "$rc"
"""
