"""The quick exit of ft's processes (errors.exit_process): the exit code, what the process printed, its exit
handlers and its other threads are all as a normal exit leaves them; only the interpreter's teardown is skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from finetune.errors import exit_process

out = Path(sys.argv[1])
def later():
    time.sleep(0.3)
    out.with_suffix(".thread").write_text("done")

def main():
    atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
    threading.Thread(target=later).start()
    sys.stdout.write("no newline, still buffered")
    {end}

exit_process(main)
"""


@pytest.mark.parametrize(
    "end, code, stderr",
    [
        ("sys.exit(3)", 3, ""),
        ("return None", 0, ""),
        ("sys.exit('stopped: why')", 1, "stopped: why"),
        ("sys.exit()", 0, ""),
    ],
)
def test_exit_process_keeps_what_a_normal_exit_does(tmp_path, end, code, stderr):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("{end}", end))
    out = tmp_path / "marker"
    done = subprocess.run([sys.executable, str(script), str(out)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == code
    assert done.stdout == "no newline, still buffered"
    assert done.stderr.strip() == stderr
    assert out.with_suffix(".atexit").read_text() == "ran"
    assert out.with_suffix(".thread").read_text() == "done"  # a non-daemon thread is waited for


def test_the_ft_command_keeps_its_exit_codes_and_messages(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("model: {name: x}\ntrain: {lrr: 1}\n")
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "plan", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "lrr" in done.stderr
    ok = subprocess.run([sys.executable, "-m", "finetune", "--help"], cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0 and "train" in ok.stdout


def test_a_profiled_process_exits_normally_so_the_profile_is_written(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.replace("{end}", "sys.exit(4)"))
    profile = tmp_path / "profile.out"
    done = subprocess.run(
        [sys.executable, "-m", "cProfile", "-o", str(profile), str(script), str(tmp_path / "marker")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # cProfile itself drops the exit code; the buffered output still comes out
    assert done.stdout == "no newline, still buffered"
    assert profile.stat().st_size > 0 and (tmp_path / "marker.atexit").read_text() == "ran"
