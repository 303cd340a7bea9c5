"""Run `ft validate` / `ft plan` on fuzz cases inside this process, each under a time limit.

Starting ft in a subprocess costs about a second on a busy machine; hundreds of cases run in-process in
seconds. `python -m tests.fuzz.runner` runs every case under a memory limit and prints the counts.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from tests.fuzz.configs import Case, generate


class CaseTimeout(BaseException):
    """Raised by SIGALRM inside a case that runs too long (a BaseException, so that no handler swallows it)."""


@dataclass
class Outcome:
    case: Case
    verdict: str  # ok | traceback | hang | accepted | wrong-exit | no-location
    code: int | None
    seconds: float
    output: str


def _alarm(signum, frame):
    raise CaseTimeout()


def _invoke(argv: list[str]) -> int | str:
    """Call ft's entry point as `ft ARGV`; the exit code, or the name of an exception that escaped."""
    from finetune import cli

    try:
        with mock.patch.object(sys, "argv", ["ft", *argv]):
            cli.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except CaseTimeout:
        raise
    except BaseException as e:  # noqa: BLE001 - an escaping exception is what the fuzzing looks for
        return f"{type(e).__name__}: {str(e)[:200]}"
    return 0


def run_case(case: Case, path: Path, timeout: float = 20.0) -> Outcome:
    """Write the case's file to `path`, run ft on it, and judge what came back."""
    path.write_bytes(case.body)
    out = io.StringIO()
    start = time.monotonic()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with mock.patch.dict(os.environ, case.env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            result = _invoke([case.command, str(path), *case.args])
    except CaseTimeout:
        result = "hang"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    seconds = time.monotonic() - start
    return Outcome(
        case,
        _verdict(case, path, result, out.getvalue()),
        result if isinstance(result, int) else None,
        seconds,
        out.getvalue() if isinstance(result, int) else f"{result}\n{out.getvalue()}",
    )


def _verdict(case: Case, path: Path, result: int | str, output: str) -> str:
    if result == "hang":
        return "hang"
    if isinstance(result, str) or "Traceback" in output or result == 1:
        return "traceback"
    if result == 0:
        return "accepted"
    if result != 2:
        return "wrong-exit"
    file = re.escape(str(path))
    missing = [e for e in case.expect if not re.search(e.replace("{file}", file), output)]
    return "no-location" if missing else "ok"


def run_all(cases: list[Case], folder: Path, timeout: float = 20.0, progress=None) -> list[Outcome]:
    folder.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i, case in enumerate(cases):
        outcomes.append(run_case(case, folder / f"case{i:04d}.yaml", timeout))
        if progress:
            progress(outcomes[-1])
    return outcomes


def summary(outcomes: list[Outcome]) -> dict:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.verdict] = counts.get(o.verdict, 0) + 1
    return {
        "cases": len(outcomes),
        **counts,
        "slowest_s": round(max(o.seconds for o in outcomes), 2),
        "total_s": round(sum(o.seconds for o in outcomes), 1),
    }


def main() -> None:
    import resource
    import tempfile

    # an alias bomb stops with MemoryError, not the machine
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    verbose = "-v" in sys.argv

    def show(o: Outcome) -> None:
        if verbose and o.verdict != "ok":
            print(
                f"{o.verdict:12} {o.seconds:6.2f}s {o.case.name} {o.case.command} {o.case.args[:2]!s:.80} :: "
                f"{o.output[-300:]!r}"
            )

    with tempfile.TemporaryDirectory() as tmp:
        outcomes = run_all(generate(), Path(tmp), progress=show)
    print(summary(outcomes))


if __name__ == "__main__":
    main()
