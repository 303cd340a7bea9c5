"""Slurm: the sbatch script `ft launch --slurm` writes, run for real with a fake `srun` and `scontrol` on PATH (two
loopback "nodes"): Slurm's USR1 ahead of the time limit checkpoints every rank and requeues the job, which resumes to
the weights of an uninterrupted run. A second signal while a checkpoint is written is ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune.errors import FtError
from tests.helpers import REPO, free_port, ft_here, job, job_text, losses, setup_job, step_hook

linux = pytest.mark.skipif(not Path("/proc").is_dir(), reason="the fake srun finds processes through /proc")

# slurmstepd signals every process of a step (proctrack/cgroup): the fake srun does the same.
FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys
from pathlib import Path

args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)
nodes = int(os.environ.get("SLURM_NNODES", "1"))
tasks = [
    subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURM_LOCALID": "0"}})
    for i in range(nodes)
]


def tree(pid):
    out = [pid]
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out += tree(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def forward(signum, frame):
    with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
        log.write(f"srun got {{signal.Signals(signum).name}}\\n")
    for task in tasks:
        for pid in tree(task.pid):
            try:
                os.kill(pid, signum)
            except OSError:
                pass


for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, forward)
codes = [t.wait() for t in tasks]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
  show) for _ in $(seq 1 "${SLURM_NNODES:-1}"); do echo 127.0.0.1; done ;;
  requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
"""


def write_script(tmp_path, config: str, hardware: str, *overrides: str) -> Path:
    from finetune.workflow import write_launch_script

    return write_launch_script(config, overrides, hardware, tmp_path / "job.sbatch", "01:00:00", None)


def fake_slurm(tmp_path) -> dict:
    """PATH with the fake srun/scontrol and this environment's ft; the variables Slurm sets for a 2-node job."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_PER_TASK": "1",
        "FT_MASTER_PORT": str(free_port()),  # instead of the job-id port: tests run side by side
        "MASTER_PORT": "1",  # exported where sbatch ran: not used
        "FT_TRAIN_ARGS": "--hardware 2x1xcpu",
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.slow
def test_the_script_asks_for_whole_nodes_a_warning_ahead_of_the_limit_and_a_port_from_the_job_id(tmp_path, capfd):
    script = tmp_path / "job.sbatch"
    (tmp_path / "data" / "sft").mkdir(parents=True)
    (tmp_path / "data" / "sft" / "part-0.jsonl").write_text('{"messages": []}\n')  # ft launch checks the data paths
    example = str(REPO / "examples/yaml/mistral-7b-zero3-2x8xa100.yaml")
    code, _, err = ft_here(
        capfd,
        *["launch", example, "--slurm", "--hardware", "2x8xA100-40GB", "--out", str(script), "--partition", "gpu"],
        cwd=tmp_path,  # where the job's data/sft/*.jsonl are, and its run folder goes
        env={"HF_TOKEN": "hf_secretvalue123"},
    )
    assert code == 0, err
    text = script.read_text()
    code, out, err = ft_here(capfd, "plan", example, "--hardware", "2x8xA100-40GB", "--json", cwd=REPO)
    assert code == 0, err
    plan = json.loads(out)
    stop = plan["cluster"]["stop_seconds"]
    assert stop >= 180
    for needle in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --cpus-per-task={plan['cluster']['cpus_per_node']}",
        "#SBATCH --mem=0",
        "#SBATCH --exclusive",
        "#SBATCH --partition=gpu",
        f"#SBATCH --signal=B:USR1@{stop}",
        "#SBATCH --requeue",
        "${SLURM_JOB_ID:-0} % ",
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=",
        'scontrol requeue "${SLURM_JOB_ID:-}"',
        '--node-rank "${SLURM_NODEID:-$SLURM_PROCID}"',
        "output.resume=auto",
    ):
        assert needle in text, needle
    # the NCCL variables are exported before srun starts any process
    assert text.index("TORCH_NCCL_ASYNC_ERROR_HANDLING") < text.index("srun ")
    assert subprocess.run(["bash", "-n", str(script)], timeout=300).returncode == 0
    assert "hf_secretvalue123" not in text and "HF_TOKEN=" not in text
    # the port: the same for every node of a job, another for the next job
    ports = [
        subprocess.run(
            ["bash", "-c", f"SLURM_JOB_ID={j}; echo {slurm_port()}"],
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout.strip()
        for j in (1001, 1002)
    ]
    assert ports[0] != ports[1] and all(15000 <= int(p) < 30000 for p in ports)


def slurm_port() -> str:
    from finetune.launch.slurm import port_expression

    return port_expression()


@pytest.mark.slow
def test_ft_launch_makes_the_folder_of_the_jobs_log_and_refuses_what_ft_validate_refuses(tmp_path, monkeypatch, capfd):
    import re

    from finetune.resume import resume_point
    from finetune.workflow import write_launch_script

    monkeypatch.chdir(tmp_path)
    config = job(tmp_path, "unused")
    elsewhere = write_launch_script(config, ("output.dir=runs/a",), "cpu", "scripts/a.sbatch", "1:00:00", None)
    log = re.search(r"^#SBATCH --output=(.+)$", elsewhere.read_text(), re.M).group(1)
    # sbatch opens the log before the script runs and makes no folder: an absolute path, to a folder that exists
    assert log == f"{tmp_path}/runs/a/slurm-%j.out" and (tmp_path / "runs" / "a").is_dir()
    default = write_launch_script(config, ("output.dir=runs/b",), "cpu", None, "1:00:00", None)
    assert default == Path("runs/b/job.sbatch") and f"--output={tmp_path}/runs/b/slurm-%j.out" in default.read_text()
    for run in (tmp_path / "runs" / "a", tmp_path / "runs" / "b"):
        (run / "slurm-7.out").write_text("")  # Slurm's log, as the job starts: ft train starts a run there
        assert resume_point(run, True, explicit=False, overwrite=False) is None
    (tmp_path / "runs" / "c").mkdir()
    (tmp_path / "runs" / "c" / "thesis.tex").write_text("")
    with pytest.raises(FtError, match="runs/c is not empty and is not an ft run folder"):  # as ft train would
        write_launch_script(config, ("output.dir=runs/c",), "cpu", None, "1:00:00", None)
    assert not (tmp_path / "runs" / "c" / "job.sbatch").exists()

    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(config).read_text().replace(str(tmp_path / "d.jsonl"), str(tmp_path / "missing.jsonl")))
    said = [
        ft_here(capfd, *args, cwd=tmp_path)
        for args in (["validate", str(bad)], ["launch", str(bad), "--slurm", "--hardware", "cpu", "-o", "bad.sbatch"])
    ]
    assert [code for code, _, _ in said] == [2, 2], said[1][2]
    assert said[1][2] == said[0][2] and "data.datasets[0].path: data file not found" in said[0][2]
    assert not (tmp_path / "bad.sbatch").exists() and not (tmp_path / "unused").exists()


def test_the_warning_comes_earlier_for_a_larger_checkpoint():
    from finetune.plan.stopping import stop_seconds

    small, large = stop_seconds(2.0, 2**30), stop_seconds(2.0, 400 * 2**30)
    assert 180 <= small < large and large % 60 == 0


@pytest.mark.slow
@linux
def test_usr1_checkpoints_every_rank_requeues_and_the_requeued_job_resumes_to_the_uninterrupted_weights(
    tmp_path, one_process
):
    from safetensors.torch import load_file

    from finetune import checkpoint

    config, run = job(tmp_path, "run"), tmp_path / "run"
    script = write_script(tmp_path, config, "2x1xcpu")
    env = {**os.environ, **fake_slurm(tmp_path)}
    # rank 0 pauses 3 s in step 4: the warning sent after step 2 lands before the last step
    first = subprocess.Popen(
        ["bash", str(script)],
        env={**env, **step_hook(tmp_path, hang=(0, 4, 3))},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 240
    while not ((run / "metrics.jsonl").exists() and len(losses(run)) >= 2):
        assert first.poll() is None, first.communicate(timeout=300)[0][-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    first.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@N does: the batch shell alone
    out = first.communicate(timeout=240)[0]
    assert first.returncode == 138, out[-3000:]
    log = (tmp_path / "slurm.log").read_text()
    assert log.count("requeue 4242") == 1 and log.count("srun got SIGUSR1") == 1, log  # passed on once
    # torchrun's agents may log a race of their exit barrier (node 0's store closes first): torch's noise, not ft's
    assert out.count("Traceback") == out.count("Error waiting on exit barrier"), out[-3000:]
    assert "stopped by SIGUSR1 after step" in out, out[-3000:]
    last = checkpoint.latest(run)
    state = json.loads((last / "state.json").read_text())
    assert state["stopped_by"] == "SIGUSR1" and 2 <= state["step"] < 6
    assert (last / "rng-0.pt").exists() and (last / "rng-1.pt").exists()  # every rank wrote its part
    plan = json.loads((run / "plan.json").read_text())
    assert f"--shutdown-timeout={plan['cluster']['stop_seconds']}" in (run / "launch.txt").read_text()

    again = subprocess.run(
        ["bash", str(script)],
        env={**env, "SLURM_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "slurm.log").read_text().count("requeue") == 1  # a finished job is not requeued
    assert losses(run) == pytest.approx(losses(one_process), rel=1e-4, abs=1e-5)
    resumed, whole = (load_file(str(r / "final" / "model.safetensors")) for r in (run, one_process))
    assert resumed.keys() == whole.keys()
    for name in whole:
        assert resumed[name].float().allclose(whole[name].float(), atol=1e-5), name


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT])  # a scheduler's, a person's
def test_a_second_signal_while_the_checkpoint_is_written_is_ignored_and_the_checkpoint_is_complete(
    tmp_path, monkeypatch, capfd, second
):
    from finetune import checkpoint
    from finetune.distributed import lifecycle
    from finetune.errors import Stopped
    from finetune.train import run

    _, _, _, tiny = setup_job(tmp_path, job_text(tmp_path, "lora", steps=6))
    monkeypatch.setattr(lifecycle, "REPEAT_WINDOW_S", 0.0)  # every signal counts: the second is not a copy
    write_part = checkpoint._write_rank_part
    seen = []

    def slow_part(*args, **kwargs):  # the second signal arrives while this rank writes its part
        os.kill(os.getpid(), second)
        time.sleep(0.2)  # the handler runs here
        seen.append("second")
        return write_part(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "_write_rank_part", slow_part)

    def first(rank, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    (tmp_path / "run").mkdir()
    with pytest.raises(Stopped) as stopped:
        run(tiny, tmp_path / "run", hooks=(first,))
    assert seen == ["second"] and "stopped by SIGTERM after step 3 of 6" in str(stopped.value)
    assert f"{signal.Signals(second).name} ignored while the checkpoint is written" in capfd.readouterr().err
    last = checkpoint.latest(tmp_path / "run")
    state = json.loads((last / "state.json").read_text())
    assert state["step"] == 3 and state["stopped_by"] == "SIGTERM"
    assert {"rng-0.pt", "scheduler.pt", "state.json"} <= {p.name for p in last.iterdir()}
    if second == signal.SIGTERM:  # and it loads: the resumed run finishes
        _, _, _, resumed = setup_job(tmp_path, job_text(tmp_path, "lora", steps=6))
        assert run(resumed, tmp_path / "run", resume_from=last)["steps"] == 6


@pytest.mark.slow
@linux
def test_the_launcher_ignores_a_second_signal_while_a_rank_writes_its_checkpoint(tmp_path, monkeypatch):
    from finetune.distributed import lifecycle
    from finetune.launch import stopping

    monkeypatch.setattr(lifecycle, "REPEAT_WINDOW_S", 0.0)
    # a stand-in for torchrun and its rank: it writes a checkpoint for 3 s once asked to stop, then ends cleanly
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, pathlib, time\n"
        f"folder = pathlib.Path(os.environ[{lifecycle.ENV_FOLDER!r}])\n"
        "while not (folder / 'stop').exists():\n    time.sleep(0.05)\n"
        "(folder / 'saving-0').touch()\ntime.sleep(3)\n(folder / 'saving-0').unlink()\n"
        f"pathlib.Path({str(tmp_path / 'done')!r}).write_text('complete')\n"
    )
    exchange = stopping.Exchange()

    def signal_twice():  # Ctrl-C twice: the second would stop at once, but for the checkpoint being written
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)  # the stop request
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)  # a second one, while the worker saves

    threading.Thread(target=signal_twice, daemon=True).start()
    try:
        code = stopping.run_forwarding_signals([sys.executable, str(worker)], dict(os.environ), exchange)
    finally:
        exchange.close()
    assert code == 0 and (tmp_path / "done").read_text() == "complete"
    assert exchange.requested == signal.SIGINT and not exchange.aborted


@pytest.mark.slow
def test_a_rank_that_makes_no_progress_explains_where_before_the_timeout():
    import io

    from finetune.distributed import runtime

    out = io.StringIO()
    done = runtime.watch_for_stalls(3, timeout_minutes=0.02, out=out)  # NCCL's watchdog: 1.2 s; ft speaks at 1.08 s
    try:
        with runtime.activity("step 7 of 9"), runtime.activity("forward/backward of micro-batch 2 of 4"):
            time.sleep(2.0)
            said = out.getvalue()
        with runtime.activity("step 8 of 9"):
            time.sleep(0.3)  # progress: nothing more is said
    finally:
        done.set()
    assert said.count("rank 3 has waited") == 1, said
    assert "during step 7 of 9: forward/backward of micro-batch 2 of 4" in said
    assert "distributed.timeout_minutes" in said and "NCCL's watchdog" in said
    assert out.getvalue() == said


@pytest.mark.slow
@linux
def test_ft_launch_generate_writes_a_one_node_script_that_runs_ft_generate(tmp_path, one_process, capfd):
    from finetune.tiny import arithmetic_records, write_jsonl

    prompts = write_jsonl(arithmetic_records(6, seed=3), tmp_path / "prompts.jsonl")
    out, script = tmp_path / "gen" / "out.jsonl", tmp_path / "gen.sbatch"
    args = [str(one_process), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4", "--quiet"]
    launch = ["launch", "generate", "--slurm", "--hardware", "cpu", "-o", str(script)]
    code, _, err = ft_here(capfd, *launch, "--", *args, cwd=REPO)
    assert code == 0, err
    text = script.read_text()
    assert "#SBATCH --nodes=1" in text and "#SBATCH --exclusive" in text and "--gpus-per-node" not in text
    assert f"#SBATCH --output={out.parent}/slurm-%j.out" in text
    code, _, err = ft_here(capfd, *launch, "--", str(one_process), "--prompts", str(prompts))
    assert code != 0 and "--out" in err and "Traceback" not in err
    env = {**os.environ, **fake_slurm(tmp_path), "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1"}
    ran = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(isinstance(row["completion"], str) for row in rows)


def test_a_signal_before_training_begins_ends_ft_train_with_its_code_and_a_message():
    from finetune.errors import Stopped
    from finetune.launch.stopping import stopped_before_launch

    before = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(Stopped) as info, stopped_before_launch():
        os.kill(os.getpid(), signal.SIGUSR1)  # its default action would kill the process without a word
        time.sleep(1)
    assert info.value.exit_code == 138 and "stopped by SIGUSR1 before training began" in str(info.value)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_ft_plan_says_how_long_a_stop_takes(capsys):
    from finetune.report import print_plan
    from finetune.workflow import compile_plan

    plan = compile_plan(str(REPO / "examples/yaml/mistral-7b-zero3-2x8xa100.yaml"), (), "2x8xA100-40GB")
    print_plan(plan)
    text = " ".join(capsys.readouterr().out.split())
    assert f"{plan.stop_seconds} s from a stop signal to a complete checkpoint" in text
    assert f"{plan.checkpoint_bytes / 2**30:.1f} GiB per node per checkpoint" in text
