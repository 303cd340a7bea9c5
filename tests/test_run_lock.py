"""A run folder is written by one job at a time (finetune/runlock.py): a second `ft train` of a folder that a job is
writing, with --overwrite or without, is refused with the holder's PID and host and changes nothing; the lock lasts
as long as any process of the job (ranks that finish their checkpoint after their launcher was killed too); a lock
file left by a killed job locks nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.artifacts.run import LOCK
from finetune.errors import FtError
from finetune.runlock import joined, locked
from tests.helpers import REPO, ft_here, job, metric_rows

linux = pytest.mark.skipif(not Path("/proc").is_dir(), reason="flock and process groups as on Linux")

# FT_STEP_HOOK: every rank stops at the start of step STEP until the test creates FOLDER/go (a file, not a delay)
PAUSE = """
import time
from pathlib import Path

FOLDER = Path({folder!r})


def hook(rank, step):
    if step == {step}:
        (FOLDER / f"paused-{{rank}}").touch()
        deadline = time.monotonic() + 300  # a failed test never leaves a rank waiting for good
        while not (FOLDER / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
"""

HOLD = """
import sys, time
from pathlib import Path
from finetune.runlock import locked

with locked(sys.argv[1], "ft train other.yaml"):
    print("held", flush=True)
    while not Path(sys.argv[2]).exists():
        time.sleep(0.05)
"""


def pause_at(tmp_path, step: int) -> dict:
    hook = tmp_path / "pause_hook.py"
    hook.write_text(PAUSE.format(folder=str(tmp_path), step=step))
    return {"FT_STEP_HOOK": f"{hook}:hook"}


def start_train(config: str, hardware: str, env: dict, out) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", config, "--hardware", hardware, "--set", "output.save_steps=2"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(path: Path, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s: {log.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.slow
@linux
def test_overwrite_of_a_run_still_training_is_refused_with_its_pid_and_host_and_the_run_finishes_intact(
    tmp_path, capfd
):
    from finetune import checkpoint
    from finetune.workflow import run_train

    config, run, log = job(tmp_path, "run", steps=6), tmp_path / "run", tmp_path / "first.log"
    with open(log, "w") as out:
        first = start_train(config, "cpu", pause_at(tmp_path, 3), out)
    try:
        wait_for(tmp_path / "paused-0", first, log)  # step 2's checkpoint is written; step 3 waits
        code, _, said = ft_here(capfd, "train", config, "--hardware", "cpu", "--overwrite")
        assert code == 2, said[-3000:]
        assert f"PID {first.pid} on host {socket.gethostname()}" in said and "is in use" in said, said
        assert "Traceback" not in said and str(run / LOCK) in said
        with pytest.raises(FtError, match=rf"is in use: ft train .*PID {first.pid}"):  # without --overwrite too
            run_train(config, ["output.save_steps=2"], "cpu")
        assert [p.name for p in checkpoint.checkpoints(run)] == ["step-00000002"]  # nothing of it was removed
    finally:
        (tmp_path / "go").touch()
    assert first.wait(timeout=240) == 0, log.read_text()[-3000:]
    assert [r["step"] for r in metric_rows(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # one run's steps, once
    assert [p.name for p in checkpoint.checkpoints(run)] == ["step-00000002", "step-00000004"]
    assert json.loads((run / "result.json").read_text())["steps"] == 6 and (run / "final").is_dir()
    assert not (run / LOCK).exists() and not list((run / "final").rglob(".ft-*"))  # gone; never copied out
    with locked(run, "the next job"):  # released
        pass


@pytest.mark.slow
@linux
def test_ranks_that_outlive_a_killed_launcher_keep_the_run_folder_locked_until_they_exit(tmp_path):
    from finetune import checkpoint

    config, run, log = job(tmp_path, "run", steps=6), tmp_path / "run", tmp_path / "first.log"
    with open(log, "w") as out:  # to a file: the orphaned ranks would hold a pipe open
        launcher = start_train(config, "cpu:2", pause_at(tmp_path, 3), out)
    try:
        wait_for(tmp_path / "paused-1", launcher, log)
        wait_for(tmp_path / "paused-0", launcher, log)
        launcher.kill()  # SIGKILL, as an OOM kill: its ranks lose their launcher in step 3
        launcher.wait(timeout=30)
        with pytest.raises(FtError, match=rf"PID {launcher.pid} .*has exited.*its ranks.*still hold the lock"):
            with locked(run, "ft train --overwrite"):
                pass
    finally:
        (tmp_path / "go").touch()
    deadline = time.monotonic() + 240
    while True:  # the ranks finish step 3, write its checkpoint and exit: then the folder is free
        try:
            with locked(run, "ft train --overwrite"):
                break
        except FtError:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    last = checkpoint.latest(run)
    assert json.loads((last / "state.json").read_text())["stopped_by"] == "SIGTERM", log.read_text()[-3000:]


def test_the_lock_names_its_holder_and_a_left_lock_file_or_a_refused_start_leaves_nothing_in_the_way(tmp_path):
    run, done = tmp_path / "runs" / "a", tmp_path / "done"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run), str(done)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FtError) as refused:
            with locked(run, "ft train job.yaml"):
                pass
        said = str(refused.value)
        assert f"ft train other.yaml (PID {holder.pid} on host {socket.gethostname()}" in said
        assert "wait for that job to end" in said and "has exited" not in said
        with pytest.raises(FtError, match="locked by another job"):  # a rank whose launcher lost the folder
            with joined(run):
                pass
    finally:
        done.touch()
        holder.wait(timeout=60)
    assert not (tmp_path / "runs").exists()  # it made the folders for its lock, and left nothing

    # what a SIGKILLed job leaves: the file with a dead process's PID, locked by no one
    run.mkdir(parents=True)
    (run / LOCK).write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname(), "command": "ft train"}))
    with locked(run, "ft train job.yaml") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        lock.share()
        with joined(run):  # the job's ranks join the shared lock
            pass
        with pytest.raises(FtError, match=f"PID {os.getpid()}"):
            with locked(run, "another ft train"):
                pass
    assert list(run.iterdir()) == []  # the last holder removed the lock file; the folder it did not make stays


def test_a_second_ft_train_gets_no_further_than_the_lock(tmp_path, monkeypatch):
    """Before the lock nothing of the folder is read; after a refusal nothing was written or removed."""
    from finetune.workflow import run_train

    config, run, done = job(tmp_path, "run"), tmp_path / "run", tmp_path / "done"
    run.mkdir()
    (run / ".ft-run").write_text("")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # the live run's
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run), str(done)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        prepared = []
        monkeypatch.setattr("finetune.data.preprocess.prepare", lambda *a, **k: prepared.append(1))
        for flags in ({"overwrite": True}, {"resume": True}, {}):
            with pytest.raises(FtError, match=f"PID {holder.pid}"):
                run_train(config, (), "cpu", **flags)
        assert not prepared and (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    finally:
        done.touch()
        holder.wait(timeout=60)
    assert holder.returncode == 0 and sorted(p.name for p in run.iterdir()) == [".ft-run", "metrics.jsonl"]
