"""The launcher's side of a stop (the protocol and a rank's side: finetune/distributed/lifecycle.py): torchrun
started in a session of its own that dies with ft, the stop signals ft receives passed on once, as a stop request
the ranks read from the exchange folder, and a second Ctrl-C that kills them at once unless a checkpoint is being
written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.distributed.lifecycle import (
    ENV_FOLDER,
    ENV_LAUNCHER,
    PR_SET_PDEATHSIG,
    SAVING_FILE,
    STOP_FILE,
    STOP_SIGNALS,
    libc,
    note,
    reset_signals,
    signal_name,
)


def child_setup(death_signal: int, ignore: tuple[int, ...]):
    """A preexec_fn: the child ignores `ignore` (inherited through exec) and gets `death_signal` when this
    process dies (Linux), or kills itself if this process died before it could ask for that."""
    parent, lib = os.getpid(), libc()  # resolved here: the child runs between fork and exec, and does no lookups
    prctl = getattr(lib, "prctl", None) if sys.platform.startswith("linux") else None

    def setup() -> None:
        if lib is not None:
            for sig in ignore:
                lib.signal(int(sig), 1)  # SIG_IGN
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def start_torchrun(cmd: list[str], env: dict, ranks_stop_themselves: bool) -> subprocess.Popen:
    """torchrun in a session of its own (a terminal's Ctrl-C reaches the launcher alone), dying with this process.

    ranks_stop_themselves (ft's training ranks): torchrun ignores SIGTERM/SIGINT and dies by SIGKILL with the
    launcher (its ranks then get SIGTERM from their own death signal); otherwise (other workers) it handles
    them as usual and gets SIGTERM when the launcher dies, which it passes on to its workers."""
    if os.name != "posix":
        return subprocess.Popen(cmd, env=env)
    if ranks_stop_themselves:
        env = {
            **env,
            "PET_SIGNALS_TO_HANDLE": "SIGHUP,SIGQUIT",
        }  # --signals-to-handle; a torch without it handles all four
        setup = child_setup(signal.SIGKILL, STOP_SIGNALS)
    else:
        setup = child_setup(signal.SIGTERM, ())
    return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=setup)


class Exchange:
    """The launcher's folder for its ranks: the stop request it writes, the reports they write back."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="ft-launch-"))
        self.requested = 0  # the signal of the stop request, once made
        self.aborted = 0  # the signal that stopped the ranks at once, if one did

    def env(self) -> dict:
        return {ENV_FOLDER: str(self.folder), ENV_LAUNCHER: str(os.getpid())}

    def request_stop(self, signum: int) -> None:
        """Ask every rank to stop after its current step, as if it had received `signum`."""
        self.requested = signum
        tmp = self.folder / f".{STOP_FILE}.tmp"
        tmp.write_text(signal_name(signum))
        os.replace(tmp, self.folder / STOP_FILE)

    def saving(self) -> bool:
        """True while a rank writes a checkpoint."""
        return any(self.folder.glob(SAVING_FILE.format(rank="*")))

    def reports(self) -> list[dict]:
        """What the ranks that stopped on a signal wrote (rank, outcome, signal, message or during), lowest rank
        first."""
        out = []
        for path in sorted(self.folder.glob("rank-*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(out, key=lambda r: r.get("rank", 0))

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks): /proc on Linux, `ps` elsewhere."""
    found = []
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                if int(fields[1]) == pid:
                    found.append(int(entry.name))
        return found
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return found
    return [int(a) for a, b in (line.split() for line in out.splitlines() if len(line.split()) == 2) if int(b) == pid]


def kill_now(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its ranks (each leads a process group of its own): torchrun first, so that it cannot
    report the ranks' deaths; its ranks found before, since they are no longer its children after."""
    ranks = children(proc.pid)
    killpg = getattr(os, "killpg", None)
    for pid in [proc.pid, *ranks]:
        for kill in ([killpg] if killpg else []) + [os.kill]:
            try:
                kill(pid, signal.SIGKILL)
                break
            except OSError:  # not a group leader, or gone already
                continue


def run_forwarding_signals(cmd: list[str], env: dict, exchange=None) -> int:
    """Run torchrun (`cmd`) in a session of its own that dies with ft, pass on the stop signals ft receives
    (SIGTERM, SIGINT, SIGUSR1), and return torchrun's exit code. `ft train` and `ft generate` start their workers
    through it.

    With an `exchange` (ft's training ranks): the first becomes a stop request that every rank turns into that
    signal, to stop after its step with a checkpoint; copies of it within a short window are ignored, and so is
    any while a rank writes a checkpoint; a later one kills torchrun and the ranks at once. Without (other
    workers): each signal, less copies, goes to torchrun (SIGUSR1 as SIGTERM), which passes it to its workers."""
    if exchange is not None:
        env = {**env, **exchange.env()}
    started = []  # torchrun, once started; a stop request made before that is read by the ranks when they start

    def forward(signum, frame):
        if note(signum) == "repeat":
            return
        if exchange is None:
            if not started:
                raise KeyboardInterrupt  # nothing started yet to pass it to: stop here
            # torchrun stops its workers on SIGTERM; SIGUSR1 (Slurm's warning) would kill it without them
            passed = signum if signum in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM
            started[0].send_signal(passed)
        elif not exchange.requested:
            exchange.request_stop(signum)
        elif exchange.saving() or signum != signal.SIGINT:  # a checkpoint is written, or a scheduler signals again
            sys.stderr.write(f"ft: {signal_name(signum)} ignored: the ranks are stopping (SIGKILL stops at once)\n")
        elif not exchange.aborted and started:
            exchange.aborted = signum
            kill_now(started[0])

    with _handling_stops(forward):
        started.append(start_torchrun(cmd, env, ranks_stop_themselves=exchange is not None))
        return started[0].wait()


@contextlib.contextmanager
def stopped_before_launch():
    """While ft train plans and prepares the data: a stop signal ends it at once with 128+signal (SIGUSR1's default
    would kill it without a word, and a Slurm script requeues on that code); nothing is in progress to save."""
    from finetune.errors import Stopped

    def stop(signum, frame):
        if note(signum) != "repeat":
            raise Stopped(f"stopped by {signal_name(signum)} before training began; nothing to save", signum)

    with _handling_stops(stop):
        yield


@contextlib.contextmanager
def _handling_stops(handler):
    """`handler` for every stop signal (the signals noted so far forgotten), the previous handlers restored after."""
    reset_signals()
    old = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
