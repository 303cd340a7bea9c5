"""Stop signals and launcher deaths in multi-process runs (finetune/distributed/lifecycle.py).

A terminal's Ctrl-C (SIGINT to the foreground process group) and a scheduler's SIGTERM to every process stop
a 2-process run once: after a step, with its checkpoint, one message, exit 128+signal, no traceback. Ranks
do not outlive a SIGKILLed launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, ft_here, job, job_text, launch_here, losses, setup_job, step_hook

STEPS = 24
linux = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes through /proc")


def start(config: str, *args, env=None, out=None) -> subprocess.Popen:
    """`ft train` in a session of its own, as a shell starts a foreground job: os.killpg reaches what a Ctrl-C reaches.
    Output to pipes, or to the open file `out`."""
    return subprocess.Popen(
        [sys.executable, "-m", "finetune", "train", config, "--hardware", "cpu:2", *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=out or subprocess.PIPE,
        stderr=subprocess.STDOUT if out else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_steps(run: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    metrics, deadline = run / "metrics.jsonl", time.time() + timeout
    while not (metrics.exists() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, "ft train ended before the signal"
        assert time.time() < deadline, f"fewer than {n} steps after {timeout} s"
        time.sleep(0.2)


def descendants(pid: int) -> list[int]:
    from finetune.launch.stopping import children

    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


def rank_processes(run: Path) -> list[tuple[int, str]]:
    """Live processes of this run's ranks (and their torchrun): cmdline names finetune.rank and the run folder."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (
            "finetune.rank" in cmd and str(run) in cmd and state not in ("Z", "X")
        ):  # a zombie is dead, only not yet reaped
            alive.append((int(entry.name), cmd))
    return alive


def stopped_once(proc: subprocess.Popen, signame: str, run: Path) -> int:
    """The run ended after a step with that step's checkpoint, exit 128+signal, one message and no traceback."""
    out, err = proc.communicate(timeout=240)
    text = out + err
    assert proc.returncode == 128 + getattr(signal, signame), text[-3000:]
    assert text.count("stopped by") == 1 and f"stopped by {signame} after step" in text, text[-3000:]
    for needle in ("Traceback", "SignalException", "ChildFailedError", "closing signal", "interrupted"):
        assert needle not in text, text[-3000:]
    assert "Resume with: ft train CONFIG --resume" in text
    from finetune import checkpoint

    last = checkpoint.latest(run)
    state = json.loads((last / "state.json").read_text())
    assert (
        state["stopped_by"] == signame
        and f"after step {state['step']} of {STEPS}" in text
        and f"saved to {last}" in text
    )
    assert len(losses(run)) == state["step"] < STEPS  # stopped after the step it logged last, before the end
    return state["step"]


@pytest.fixture
def no_leftovers(tmp_path):
    """Whatever a failed assertion leaves running of this test's runs is killed at the end."""
    yield
    for pid, _ in rank_processes(tmp_path):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
@linux
def test_ctrl_c_and_a_scheduler_sigterm_stop_a_two_process_run_once_and_resume_finishes(tmp_path, no_leftovers):
    config, run = job(tmp_path, "run", steps=STEPS), tmp_path / "run"
    # Rank 0 pauses 3 s in step 5 (its peer waits in the step's first collective): the stop requested after step 3
    # has landed before step 5 ends, however fast the machine.
    ctrl_c = start(config, env=step_hook(tmp_path, hang=(0, 5, 3)))
    wait_for_steps(run, 3, ctrl_c)
    # what a terminal's Ctrl-C does: the foreground group (torchrun has a session of its own)
    os.killpg(ctrl_c.pid, signal.SIGINT)
    first = stopped_once(ctrl_c, "SIGINT", run)
    assert 3 <= first <= 5

    # Slurm/Kubernetes: SIGTERM to every process (ft, torchrun, both ranks) at once; the ranks also hear it from ft.
    slurm = start(config, "--resume", env=step_hook(tmp_path, hang=(0, first + 4, 3)))
    wait_for_steps(run, first + 2, slurm)
    everyone = [slurm.pid, *descendants(slurm.pid)]
    assert len(everyone) >= 4, everyone  # ft, torchrun, 2 ranks
    for pid in everyone:
        os.kill(pid, signal.SIGTERM)
    second = stopped_once(slurm, "SIGTERM", run)
    assert first + 2 <= second <= first + 4

    launch_here(config, resume=True)  # ft train --hardware cpu:2 --resume, this process the launcher
    assert (run / "final").is_dir() and len(losses(run)) == STEPS
    assert [
        json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
    ] == list(range(1, STEPS + 1))


@pytest.mark.slow
@linux
def test_a_signal_one_rank_alone_heard_stops_every_rank_for_that_signal(tmp_path, no_leftovers, capfd):
    """The ranks agree after each step on the stop signal itself, not only on whether one came: a rank that has not
    heard it yet (its watchdog polls for the launcher's request) stops after the same step for the same reason."""
    from finetune import checkpoint

    config, run = job(tmp_path, "run", steps=6), tmp_path / "run"
    code, out, err = ft_here(
        capfd, "train", config, "--hardware", "cpu:2", env=step_hook(tmp_path, signal=(1, 2, "SIGINT")), timeout=240
    )
    text = out + err
    assert code == 128 + signal.SIGINT, text[-3000:]
    assert "stopped by SIGINT after step 2 of 6" in text and "Traceback" not in text, text[-3000:]
    state = json.loads((checkpoint.latest(run) / "state.json").read_text())
    assert (state["step"], state["stopped_by"]) == (2, "SIGINT")


@pytest.mark.slow
@linux
def test_ranks_do_not_outlive_a_killed_launcher(tmp_path, no_leftovers):
    config, run = job(tmp_path, "run", steps=5000), tmp_path / "run"
    with open(tmp_path / "out.txt", "w") as out:
        launcher = start(config, out=out)  # to a file: the orphaned ranks would hold a pipe open
    wait_for_steps(run, 3, launcher)
    assert rank_processes(run)
    launcher.kill()  # SIGKILL, as an OOM kill
    launcher.wait(timeout=30)
    deadline = time.time() + 30
    while rank_processes(run) and time.time() < deadline:
        time.sleep(0.5)
    assert rank_processes(run) == [], (tmp_path / "out.txt").read_text()[-3000:]
    # What the ranks do without their launcher: stop as on SIGTERM, after the step, with its checkpoint.
    from finetune import checkpoint

    last = checkpoint.latest(run)
    assert last is not None and json.loads((last / "state.json").read_text())["stopped_by"] == "SIGTERM"
    assert "(the ranks' launcher, torchrun or ft train, is gone)" in (tmp_path / "out.txt").read_text()


def test_outside_the_loop_a_rank_stops_at_once_while_setting_up_and_finishes_the_final_save(monkeypatch):
    from finetune.distributed import lifecycle

    lifecycle.reset_signals()
    with pytest.raises(KeyboardInterrupt):  # setting up: no step to finish
        lifecycle.outside_the_loop(signal.SIGINT, None)
    lifecycle.outside_the_loop(signal.SIGTERM, None)  # a copy of it: ignored while the rank unwinds
    lifecycle.reset_signals()
    lifecycle.loop_finished()
    lifecycle.outside_the_loop(signal.SIGTERM, None)  # after the last step: the final weights are saved first
    monkeypatch.setattr(lifecycle, "REPEAT_WINDOW_S", 0.0)
    lifecycle.outside_the_loop(signal.SIGTERM, None)  # a scheduler's second SIGTERM: the save goes on
    with pytest.raises(KeyboardInterrupt):  # a person's second Ctrl-C: at once
        lifecycle.outside_the_loop(signal.SIGINT, None)
    lifecycle.reset_signals()


@pytest.mark.slow
def test_copies_of_one_signal_count_once_and_a_later_one_stops_at_once(monkeypatch):
    from finetune.distributed import lifecycle
    from finetune.train import SignalStop

    monkeypatch.setattr(lifecycle, "REPEAT_WINDOW_S", 0.5)
    before = signal.getsignal(signal.SIGINT)
    with SignalStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, and the same stop by other routes a moment later
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.signum == signal.SIGINT  # one request to stop after the step: no KeyboardInterrupt
        time.sleep(0.6)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler signalling again (cgroup tracking): the stop goes on
        time.sleep(0.05)
        assert stop.signum == signal.SIGINT
        time.sleep(0.6)
        with pytest.raises(KeyboardInterrupt):  # a deliberate second Ctrl-C after the window: stop now
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before
    with SignalStop() as again:  # a new loop starts with no signal noted: its first signal is a first again
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert again.signum == signal.SIGTERM


# ---------------------------------------------------------------- the test hook of the loop (FT_STEP_HOOK)
@pytest.mark.slow
def test_the_loop_calls_every_step_hook_and_a_true_stops_after_that_step_as_on_sigterm(tmp_path):
    from finetune import checkpoint
    from finetune.errors import Stopped
    from finetune.train import run

    _, _, _, job = setup_job(tmp_path, job_text(tmp_path, "lora", steps=6))
    seen = []

    def watch(rank, step):
        seen.append((rank, step))

    def stop(rank, step):
        return step == 3

    (tmp_path / "run").mkdir()
    with pytest.raises(Stopped) as info:
        run(job, tmp_path / "run", hooks=(stop, watch))
    assert seen == [(0, 1), (0, 2), (0, 3)]  # every hook runs, before its step
    assert info.value.exit_code == 143 and "stopped by SIGTERM after step 3 of 6" in str(info.value)
    state = json.loads((checkpoint.latest(tmp_path / "run") / "state.json").read_text())
    assert state["step"] == 3 and state["stopped_by"] == "SIGTERM"


def test_ft_step_hook_is_read_from_the_environment_and_a_broken_one_names_the_variable(tmp_path, monkeypatch):
    from finetune.errors import FtError
    from finetune.rank import STEP_HOOK, step_hooks

    monkeypatch.delenv(STEP_HOOK, raising=False)
    assert step_hooks() == ()
    ((name, spec),) = step_hook(tmp_path, fail=(1, 2), stop_at=4).items()
    monkeypatch.setenv(name, spec)
    (hook,) = step_hooks()
    assert hook(0, 4) is True and hook(1, 3) is False
    with pytest.raises(RuntimeError, match="injected failure on rank 1 at step 2"):
        hook(1, 2)
    monkeypatch.setenv(STEP_HOOK, f"{tmp_path / 'missing.py'}:hook")
    with pytest.raises(FtError, match=r"FT_STEP_HOOK: .*missing\.py.* does not exist"):
        step_hooks()
