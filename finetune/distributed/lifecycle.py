"""How the processes of a multi-process job stop together, once, and die with their launcher.

The processes: `ft train` (the launcher) starts torchrun's agent, which starts the ranks. What torchrun
(2.x) does with signals, and why ft does not let it handle SIGTERM/SIGINT:

- The agent starts each rank in a session of its own (`start_new_session`), so a terminal's Ctrl-C never
  reaches the ranks directly; it reaches the foreground process group: ft, and torchrun if it shares it.
- The agent handles SIGTERM/SIGINT (and SIGHUP, SIGQUIT; `--signals-to-handle`, PET_SIGNALS_TO_HANDLE)
  by raising SignalException: it sends that signal to every rank's process group, waits up to its shutdown
  timeout (30 s by default) and SIGKILLs what is left; a second signal during that wait sends SIGTERM on
  top; and it then exits with the SignalException's traceback. A rank that exits non-zero makes it print a
  ChildFailedError report with a traceback.

So the launcher starts torchrun in a session of its own (a terminal's Ctrl-C reaches ft alone), with
SIGTERM, SIGINT and SIGUSR1 ignored (torchrun leaves a signal that is not in its list as it found it: ft sets the list
to SIGHUP,SIGQUIT through PET_SIGNALS_TO_HANDLE; torch versions without that option still handle all four),
dying by SIGKILL when the launcher dies. torchrun's agent thus never takes part in a stop; its shutdown
timeout (for SIGHUP/SIGQUIT) is set to the plan's stop time all the same (FT_STOP_SECONDS, plan/stopping.py).
SIGUSR1 is Slurm's warning ahead of a time limit (`--signal=B:USR1@N`, passed on by the batch script): a stop
like SIGTERM's, after which the script requeues the job.

The launcher turns the first stop signal it receives into a stop request, a file in its exchange folder that
each rank's watchdog thread polls and turns into that signal in its own process (unless the rank has one
already). The rank finishes its step, saves the checkpoint with the others, writes what happened into the folder
and exits 0 (so that torchrun reports no failure); the launcher reads it and says it once, with exit code
128+signal. A signal that reaches every process (Slurm, Kubernetes) reaches the ranks directly as well: copies
of one signal that arrive within REPEAT_WINDOW_S count as one. Once a stop is under way, a scheduler's repeated
SIGTERM or SIGUSR1 (cgroup tracking can deliver two) is ignored by the ranks and by the launcher: the stop ends
with its checkpoint. A person's second Ctrl-C (SIGINT, after the window) stops at once, except while a
checkpoint is written (each rank marks it in the exchange folder): the launcher SIGKILLs torchrun and the ranks
(nothing prints; checkpoints are written to a temporary folder and renamed, so a killed save leaves the earlier
ones intact). Outside the training loop a first signal stops a rank at once while it sets up (no step to
finish), and is ignored after the last step (the rank finishes saving the final weights).

A rank whose parent (torchrun) dies gets SIGTERM (Linux PR_SET_PDEATHSIG; elsewhere the watchdog notices
that the parent or the launcher is gone) and stops as on any SIGTERM: after its step, with a checkpoint;
if it has not exited ORPHAN_GRACE_S (or the plan's stop time, if longer) later (a peer gone, a collective that
never returns) it exits at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# SIGUSR1: Slurm's warning ahead of a time limit (absent on Windows)
STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)
REPEAT_WINDOW_S = 2.0  # copies of one signal (several routes, one event) arrive within milliseconds
ORPHAN_GRACE_S = 120.0  # a rank without its launcher: time to finish the step and save before it exits anyway
POLL_S = 0.5

ENV_FOLDER = "FT_LAUNCH_FOLDER"  # the launcher's exchange folder: its stop request, the ranks' reports
ENV_LAUNCHER = "FT_LAUNCHER_PID"
ENV_STOP_SECONDS = "FT_STOP_SECONDS"  # the plan's time from a stop signal to a complete checkpoint
STOP_FILE = "stop"
SAVING_FILE = "saving-{rank}"  # present while that rank writes a checkpoint
LOST_PEERS = "lost peers"  # a rank's report: its collective timed out or a peer went away (errors.LostPeers)
_PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------------ signals arriving by several routes
class _Signals:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.burst_at: float | None = None  # when the latest burst of signals began
        self.bursts = 0
        self.signum = 0  # the signal of the latest burst


_signals = _Signals()


def note(signum: int) -> str:
    """Record a stop signal: "repeat" for a copy of one noted less than REPEAT_WINDOW_S ago (the same event by
    another route: a terminal, Slurm, the launcher, the parent's death), else "first" or "again"."""
    now = time.monotonic()
    if _signals.burst_at is not None and now - _signals.burst_at < REPEAT_WINDOW_S:
        return "repeat"
    _signals.burst_at, _signals.signum = now, signum
    _signals.bursts += 1
    return "first" if _signals.bursts == 1 else "again"


def reset_signals() -> None:
    """Forget the signals noted so far (a new training loop in this process starts with none)."""
    _signals.reset()


def signal_number(name: str) -> int:
    """SIGINT -> 2 (an unknown name: SIGTERM)."""
    return int(getattr(signal, name, signal.SIGTERM))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------------ the launcher's side
def _libc():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None


def _child_setup(death_signal: int, ignore: tuple[int, ...]):
    """A preexec_fn: the child ignores `ignore` (inherited through exec) and gets `death_signal` when this
    process dies (Linux), or kills itself if this process died before it could ask for that."""
    parent, libc = os.getpid(), _libc()  # resolved here: the child runs between fork and exec, and does no lookups
    prctl = getattr(libc, "prctl", None) if sys.platform.startswith("linux") else None

    def setup() -> None:
        if libc is not None:
            for sig in ignore:
                libc.signal(int(sig), 1)  # SIG_IGN
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
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
        setup = _child_setup(signal.SIGKILL, STOP_SIGNALS)
    else:
        setup = _child_setup(signal.SIGTERM, ())
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

    reset_signals()
    old = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        started.append(start_torchrun(cmd, env, ranks_stop_themselves=exchange is not None))
        return started[0].wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def stopped_before_launch():
    """While ft train plans and prepares the data: a stop signal ends it at once with 128+signal (SIGUSR1's default
    would kill it without a word, and a Slurm script requeues on that code); nothing is in progress to save."""
    from finetune.errors import Stopped

    def stop(signum, frame):
        if note(signum) != "repeat":
            raise Stopped(f"stopped by {signal_name(signum)} before training began; nothing to save", signum)

    reset_signals()
    old = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------ a rank's side
def under_launcher() -> bool:
    """True in a rank that ft train's launcher started (it reads the ranks' reports and prints the one message)."""
    return bool(os.environ.get(ENV_FOLDER))


def launcher_alive() -> bool:
    pid = os.environ.get(ENV_LAUNCHER)
    return bool(pid) and _alive(int(pid))


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def orphaned() -> bool:
    """True in a rank whose parent (torchrun) or launcher is gone: no one else will say what happened."""
    return _rank["parent"] is not None and (
        os.getppid() != _rank["parent"] or (under_launcher() and not launcher_alive())
    )


_rank = {"parent": None, "trained": False}


def _outside_the_loop(signum, frame) -> None:
    """A stop signal outside the training loop (SignalStop). While setting up there is no step to finish: stop now.
    After the last step the rank finishes saving the final weights: only a person's second Ctrl-C stops it now."""
    kind = note(signum)
    if kind == "repeat" or (_rank["trained"] and (kind == "first" or signum != signal.SIGINT)):
        return
    raise KeyboardInterrupt


def loop_finished() -> None:
    """The training loop ran to its last step (SignalStop calls it)."""
    _rank["trained"] = True


def ignore_stop_signals() -> None:
    """The rank is stopping already: a later signal must not interrupt its exit."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def die_with_parent(signum: int) -> bool:
    """Ask Linux to send `signum` to this process when its parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "prctl"):
        return False
    return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def start_rank() -> None:
    """In a rank torchrun started: take over SIGTERM/SIGINT (which torchrun may pass down ignored; SignalStop takes
    them during the loop), die with the parent, and follow the launcher's stop request and liveness in a watchdog."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _outside_the_loop)
    parent = _rank["parent"] = os.getppid()
    die_with_parent(signal.SIGTERM)
    folder = os.environ.get(ENV_FOLDER)
    launcher = int(os.environ.get(ENV_LAUNCHER) or 0)
    threading.Thread(
        target=_watch, args=(parent, launcher, Path(folder) if folder else None), name="ft-lifecycle", daemon=True
    ).start()


def _watch(parent: int, launcher: int, folder: Path | None) -> None:
    """Turn the launcher's stop request into a signal to this process (unless one came already); stop when the
    parent or the launcher is gone, and exit at once if that stop takes longer than ORPHAN_GRACE_S."""
    requested, orphaned = False, None
    grace = max(ORPHAN_GRACE_S, float(os.environ.get(ENV_STOP_SECONDS) or 0))
    while True:
        if not requested and folder is not None and (folder / STOP_FILE).exists():
            requested = True
            if _signals.bursts == 0:
                name = (folder / STOP_FILE).read_text().strip()
                os.kill(os.getpid(), getattr(signal, name, signal.SIGTERM))
        if orphaned is None and (os.getppid() != parent or (launcher and not _alive(launcher))):
            orphaned = time.monotonic()
            if _signals.bursts == 0:
                os.kill(os.getpid(), signal.SIGTERM)
        if orphaned is not None and time.monotonic() - orphaned > grace:
            os._exit(128 + signal.SIGTERM)
        time.sleep(POLL_S)


def mark_saving(on: bool) -> None:
    """Tell the launcher that this rank writes a checkpoint (on) or has finished (off); nothing without one."""
    folder = os.environ.get(ENV_FOLDER)
    if not folder:
        return
    path = Path(folder) / SAVING_FILE.format(rank=os.environ.get("RANK", 0))
    try:
        path.touch() if on else path.unlink(missing_ok=True)
    except OSError:
        pass  # the launcher is gone with its folder


def report(outcome: str, signum: int, **fields) -> None:
    """Write this rank's report into the launcher's folder (atomically); nothing without a launcher."""
    folder = os.environ.get(ENV_FOLDER)
    if not folder or orphaned():
        return
    rank = int(os.environ.get("RANK", 0))
    data = {"rank": rank, "outcome": outcome, "signal": signal_name(signum), **fields}
    try:
        tmp = Path(folder) / f".rank-{rank}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, Path(folder) / f"rank-{rank}.json")
    except OSError:
        pass  # the launcher is gone with its folder


def _tell(message: str) -> None:
    """Rank 0 says what happened where no launcher will; an orphan's first local rank removes the launcher's folder."""
    if under_launcher() and not orphaned():
        return
    if int(os.environ.get("RANK", 0)) == 0:
        sys.stderr.write(message + "\n")
    if under_launcher() and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        import shutil

        shutil.rmtree(os.environ[ENV_FOLDER], ignore_errors=True)


def rank_stopped(message: str, signum: int) -> int:
    """After a clean stop (the checkpoint saved): report it, and exit 0 so that torchrun reports no failure.
    The launcher says it once; without one, rank 0 does."""
    ignore_stop_signals()
    if orphaned():
        message = f"{message} (the ranks' launcher, torchrun or ft train, is gone)"
    report("stopped", signum, message=message)
    _tell(message)
    return 0


def rank_interrupted(during: str) -> int:
    """After a stop signal that could not wait for a step's end (during setup, or a second signal): report it.
    A first stop request ends the rank with 0 (the launcher says what happened); a second one with 128+signal."""
    ignore_stop_signals()
    signum = _signals.signum or signal.SIGINT
    report("interrupted", signum, during=during)
    _tell(f"interrupted: stopped by {signal_name(signum)} during {during}; nothing of this point was saved")
    return 0 if under_launcher() and not orphaned() and _signals.bursts <= 1 else 128 + signum
