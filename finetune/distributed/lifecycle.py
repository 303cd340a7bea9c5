"""How the processes of a multi-process job stop together, once, and die with their launcher: the protocol, and a
rank's side of it (the launcher's side is finetune/launch/stopping.py).

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

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

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
PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------------ signals arriving by several routes
# when the latest burst of signals began, how many bursts there were, and the signal of the latest
_signals = SimpleNamespace(burst_at=None, bursts=0, signum=0)


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
    """Forget the signals noted so far and that a loop finished (a new training loop in this process starts with
    neither)."""
    _signals.burst_at, _signals.bursts, _signals.signum = None, 0, 0
    _rank["trained"] = False


def signal_number(name: str) -> int:
    """SIGINT -> 2 (an unknown name: SIGTERM)."""
    return int(getattr(signal, name, signal.SIGTERM))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ------------------------------------------------------------------ libc, for a death signal
def libc():
    """The C library with `signal` typed for SIG_IGN (and `prctl` on Linux); None where it cannot be loaded."""
    try:
        import ctypes

        lib = ctypes.CDLL(None, use_errno=True)
        lib.signal.restype = ctypes.c_void_p
        lib.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        return lib
    except (OSError, AttributeError):
        return None


# ------------------------------------------------------------------ a rank's side
def under_launcher() -> bool:
    """True in a rank that ft train's launcher started (it reads the ranks' reports and prints the one message)."""
    return bool(os.environ.get(ENV_FOLDER))


def launcheralive() -> bool:
    pid = os.environ.get(ENV_LAUNCHER)
    return bool(pid) and alive(int(pid))


def alive(pid: int) -> bool:
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
        os.getppid() != _rank["parent"] or (under_launcher() and not launcheralive())
    )


_rank = {"parent": None, "trained": False}


def outside_the_loop(signum, frame) -> None:
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
    lib = libc()
    if lib is None or not hasattr(lib, "prctl"):
        return False
    return lib.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0


def start_rank() -> None:
    """In a rank torchrun started: take over SIGTERM/SIGINT (which torchrun may pass down ignored; SignalStop takes
    them during the loop), die with the parent, and follow the launcher's stop request and liveness in a watchdog."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, outside_the_loop)
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
        if orphaned is None and (os.getppid() != parent or (launcher and not alive(launcher))):
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
