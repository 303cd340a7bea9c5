"""An sbatch script that runs a planned job on a SLURM cluster: one `ft train` per node, torchrun inside."""

from __future__ import annotations

import shlex

from finetune.plan.plan import Plan


def sbatch_script(
    config_path: str,
    plan: Plan,
    run_dir: str,
    job_name: str,
    time_limit: str = "24:00:00",
    partition: str | None = None,
    overrides: tuple[str, ...] = (),
) -> str:
    """The script text. SLURM sends SIGTERM two minutes before the time limit; ft then checkpoints and stops,
    and a requeued job resumes from that checkpoint (output.resume=auto)."""
    gpus = "" if "CPU" in plan.device else f"#SBATCH --gpus-per-node={plan.processes_per_node}\n"
    part = f"#SBATCH --partition={partition}\n" if partition else ""
    sets = " ".join(f"--set {shlex.quote(o)}" for o in (*overrides, "output.resume=auto"))
    cmd = (
        f'ft train {shlex.quote(config_path)} {sets} --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" '
        f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"'
    )
    return f"""#!/bin/bash
# Written by `ft launch --slurm` for {plan.model} ({plan.method}, {plan.adapter}, {plan.backend});
# plan: {plan.nodes} node(s) x {plan.processes_per_node} process(es).
#SBATCH --job-name={job_name}
#SBATCH --nodes={plan.nodes}
#SBATCH --ntasks-per-node=1
{gpus}{part}#SBATCH --time={time_limit}
#SBATCH --output={run_dir}/slurm-%j.out
#SBATCH --signal=TERM@120
#SBATCH --requeue
set -euo pipefail
mkdir -p {shlex.quote(run_dir)}
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_PORT="${{MASTER_PORT:-29500}}"
# Hub tokens and tracker keys come from the environment (HF_TOKEN, WANDB_API_KEY); never write them here.
srun --kill-on-bad-exit=1 bash -c '{cmd}'
"""
