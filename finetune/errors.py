"""Errors shown to users. The CLI prints them without a traceback and exits with their exit code."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field

Path = tuple  # a key path into the config: ("data", "datasets", 0, "format")


def dotted(path: Path) -> str:
    """("data", "datasets", 0, "format") -> "data.datasets[0].format"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def clip(text: str, limit: int = 80) -> str:
    """`text` cut to about `limit` characters for a message (a 5,000-character key is not printed whole)."""
    return text if len(text) <= limit else f"{text[: limit - 20]}...({len(text):,} characters)"


class FtError(Exception):
    """An error the user can fix; `str()` is the whole message. Exit code 2: the input was wrong."""

    exit_code = 2


class Stopped(FtError):
    """A stop signal ended the job (training after saving a checkpoint); exit code 128+signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class LostPeers(FtError):
    """The ranks lost one another: a collective timed out, or a peer went away (a node preempted or dead). Another
    attempt may well succeed, so the exit code is 134 (128+SIGABRT, as when NCCL's watchdog ends a stuck rank):
    schedulers that restart after signals and not after input errors (Kubernetes' ExitCode policy, JobSet failure
    rules) restart the job, which resumes from its last checkpoint."""

    exit_code = 134


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a job file: which keys, what is wrong, how to fix it."""

    keys: tuple[Path, ...]
    message: str
    fix: str = ""
    where: tuple[str, ...] = field(default=())  # one location per key: "cfg.yaml:12" or "--set a.b=c"

    def render(self) -> str:
        names = []
        for i, key in enumerate(self.keys):
            loc = self.where[i] if i < len(self.where) and self.where[i] else ""
            names.append(f"{clip(dotted(key)) or '(top level)'}" + (f" ({loc})" if loc else ""))
        head = " conflicts with ".join(names) if len(names) > 1 else (names[0] if names else "")
        if not self.keys and self.where:
            head = self.where[0]
        text = f"{head}: {self.message}" if head else self.message
        return text + (f"\n    fix: {self.fix}" if self.fix else "")


class ConfigError(FtError):
    """Every problem found in a job file, reported together."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  ✗ {p.render()}".replace("\n", "\n  ") for p in self.problems]
        super().__init__("\n".join(lines))


class PlanError(FtError):
    """The job cannot run on this hardware as asked; the message gives the estimate and options that fit."""


class HardwareError(FtError):
    """A hardware description that cannot be read."""


class DataError(FtError):
    """Data that cannot be read or turned into training examples; the message names the file/line or sample."""


# ---------------------------------------------------------------- the top-level handler
_state = {"debug": False, "run_dir": None}


def set_debug(on: bool = True) -> None:
    """`ft --debug`: print the traceback of an unexpected error instead of writing it to a log file."""
    _state["debug"] = on


def set_run_dir(path) -> None:
    """The run folder of this command, once known: an unexpected error's traceback is written there."""
    _state["run_dir"] = path


def run_main(fn, what: str = "ft", run_dir=None) -> None:
    """Run `fn()` and exit: 0 when it returns, the exit code of an `FtError` (with its message), 130 on Ctrl-C,
    and for anything else one message (exit 1; 2 for an OSError) with the traceback in a log file.

    Every entry point uses it (`ft`, and each rank's `python -m finetune.rank`), so that no input reaches
    the user as a traceback. `what` names the command in messages; `run_dir` is where the log goes.
    """
    if run_dir is not None:
        set_run_dir(run_dir)
    try:
        code = fn()
    except FtError as e:
        sys.stderr.write(f"error: {e}\n")
        code = e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"\ninterrupted: {what} stopped (Ctrl-C)\n")
        code = 130
    except Exception as e:  # noqa: BLE001 - this is the one place that catches everything
        code = _unexpected(e, what)
    sys.exit(code if isinstance(code, int) else 0)


# The garbage collector's first threshold in ft's processes (Python's default: 700 allocations). Starting a job
# (torch, transformers, the model) creates ~450k objects that live as long as the process, and at the default
# the collector runs thousands of times while they pile up, rescanning them: about 1 of a tiny rank's 5 CPU-s
# (bench/gc_bench.py measures it). At 20k the count of collections falls by ~30x; objects held in cycles wait a
# little longer before they are freed.
GC_YOUNG_OBJECTS = 20_000


def exit_process(main) -> None:
    """Run `main()` (which ends in sys.exit, as `run_main` does) as a process's entry point, then end the process
    without the interpreter's teardown: with torch loaded, freeing every module and object takes 1–2 s and writes
    nothing. Before leaving, what a normal exit would still do is done: other non-daemon threads are joined, the exit
    handlers run (logging's flush and close, trackers, temporary files), and stdout and stderr are flushed. Only for
    processes (the `ft` command): a caller that imports `main` keeps the SystemExit, and so does a process
    under a profiler or a tracer (cProfile, coverage), which writes its report at exit."""
    import atexit
    import gc
    import threading

    gc.set_threshold(GC_YOUNG_OBJECTS, *gc.get_threshold()[1:])
    unset = object()
    code = unset
    try:
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        if sys.getprofile() is not None or sys.gettrace() is not None:  # a profiler or coverage writes its report
            sys.exit(code)
        if not isinstance(code, int):  # sys.exit("message") or sys.exit(None), as the interpreter treats them
            if code is not None:
                sys.stderr.write(f"{code}\n")
            code = 0 if code is None else 1
        # The interpreter's own first step at exit (Py_FinalizeEx -> threading._shutdown): the callbacks registered
        # with threading._register_atexit run first, which is how concurrent.futures tells idle pool workers (torch's
        # compile pool among them) to stop; then every other non-daemon thread is joined. Joining the threads alone
        # would wait forever for those idle workers.
        threading._shutdown()
        atexit._run_exitfuncs()  # CPython's own call at exit (Modules/atexitmodule.c), exposed for this use
    except KeyboardInterrupt as stop:
        # Ctrl-C inside main itself propagates as it would without this function; from the moment main has ended
        # (its SystemExit being handled is the stop's context) it is a Ctrl-C while a thread or an exit handler
        # finishes: everything ft wrote is written. Left to the interpreter, the traceback would be followed by a
        # join of the same threads that no second Ctrl-C interrupts.
        if code is unset and not isinstance(stop.__context__, SystemExit):
            raise
        sys.stderr.write("stopped while finishing (Ctrl-C)\n")
        code = 130
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def _unexpected(e: BaseException, what: str) -> int:
    """Report an exception ft did not expect: one message, the traceback in a log (or printed with --debug)."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    input_error = isinstance(e, OSError)
    detail = " ".join(str(e).split())[:300] or "(no message)"
    lines = [f"error: {what} failed: {type(e).__name__}: {detail}"]
    frame = _innermost_ft_frame(e)
    if frame:
        lines.append(f"  at {frame}")
    if input_error and getattr(e, "filename", None):
        lines.append(f"  the file: {e.filename}")
    lines.append(
        "  this is a bug in ft or an unexpected input: check the input named above; if it looks right, "
        "report this message with the traceback"
    )
    if _state["debug"] or os.environ.get("FT_DEBUG") == "1":
        sys.stderr.write(text)
    else:
        log = _write_log(text, what)
        lines.append(f"  traceback: {log}" if log else "  traceback: run again with ft --debug to see it")
        if log:
            lines.append("  (run again with ft --debug to print it)")
    sys.stderr.write("\n".join(lines) + "\n")
    return 2 if input_error else 1


def _innermost_ft_frame(e: BaseException) -> str | None:
    """`finetune/x.py:LINE in function` for the deepest frame of ft's own code in the traceback."""
    found = None
    for frame in traceback.extract_tb(e.__traceback__):
        parts = frame.filename.replace("\\", "/").split("/")
        if "finetune" in parts:
            found = f"{'/'.join(parts[parts.index('finetune') :])}:{frame.lineno} in {frame.name}"
    return found


def _write_log(text: str, what: str) -> str | None:
    """Write the traceback to RUN/ft-error-PID.log (or $TMPDIR/ft-error-PID.log); its path, or None."""
    import tempfile
    from pathlib import Path

    folders = [Path(_state["run_dir"])] if _state["run_dir"] and Path(_state["run_dir"]).is_dir() else []
    for folder in folders + [Path(tempfile.gettempdir())]:
        path = folder / f"ft-error-{os.getpid()}.log"
        try:
            path.write_text(f"{what}\n\n{text}", encoding="utf-8")
            return str(path)
        except OSError:
            continue
    return None
