"""Which of ft's modules the launcher's path goes through: `ft train JOB ARGS...` traced from the command line to the
moment it starts torchrun (which is not started). Prints the modules whose functions ran (module and class bodies,
that is imports, and dataclass-generated code left out) and how many calls entered a module already further down the
stack (control coming back to a module it had left), then the modules that received the job file's path as an
argument and how many of those calls came back so.

    python bench/launch_path.py examples/yaml/quickstart.yaml --hardware cpu:2 --set output.dir=/tmp/lp/run

Run it from a checkout (PYTHONPATH=. traces that checkout's ft, e.g. an older commit's worktree). ft reports the
stop at the launch as an error of its own (and writes its traceback log in the run folder): that is this script.
"""

from __future__ import annotations

import inspect
import pathlib
import subprocess
import sys


class Launched(Exception):
    """torchrun would start here."""


def main(argv: list[str]) -> None:
    job = argv[0]
    called: set[str] = set()
    with_job: set[str] = set()
    back = reentries = 0
    stack: list[tuple] = []  # per live ft function frame: (its module, the frame, whether the job path is an argument)
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        command = args[0] if args else kwargs.get("args")
        if any("torch.distributed.run" in str(part) for part in command or ()):
            sys.setprofile(None)
            raise Launched()
        return real_popen(*args, **kwargs)

    def is_job(value) -> bool:
        return isinstance(value, str | pathlib.PurePath) and str(value) == job

    def profile(frame, event, arg):
        nonlocal back, reentries
        module = frame.f_globals.get("__name__", "")
        code = frame.f_code
        if not module.startswith("finetune") or code.co_name.startswith(("<", "__create_fn__")):
            return
        if not code.co_flags & inspect.CO_OPTIMIZED:  # a module's or a class's body (an import), not a function
            return
        if event == "call":
            called.add(module)
            below = [m for m, _, _ in stack]
            reentries += bool(below) and below[-1] != module and module in below
            if any(is_job(v) for v in frame.f_locals.values()):
                with_job.add(module)
                caller = next((m for m, _, job_arg in reversed(stack) if job_arg), None)
                back += caller is not None and caller != module and any(m == module for m, _, j in stack if j)
                stack.append((module, frame, True))
            else:
                stack.append((module, frame, False))
        elif event == "return" and stack and stack[-1][1] is frame:
            stack.pop()

    from finetune.cli import main as ft

    subprocess.Popen = popen
    sys.setprofile(profile)
    try:
        ft(["train", *argv])
    except (Launched, SystemExit):
        pass
    finally:
        sys.setprofile(None)
        subprocess.Popen = real_popen
    print(f"{len(called)} modules ran functions on the way to the launch; {reentries} calls entered a module that was")
    print("already further down the stack (control going back to a module it had left):")
    print("  " + " ".join(sorted(called)))
    print(f"the job file's path reached {len(with_job)} modules, and came back to one it had left {back} times:")
    print("  " + " ".join(sorted(with_job)))


if __name__ == "__main__":
    main(sys.argv[1:])
