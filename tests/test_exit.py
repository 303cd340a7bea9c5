"""The quick exit of ft's processes (errors.exit_process): the exit code, what the process printed, its exit
handlers and its other threads are all as a normal exit leaves them; only the interpreter's teardown is skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, ft_train, job

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
    ok = subprocess.run(
        [sys.executable, "-m", "finetune", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
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


POOL = """
import concurrent.futures, sys
from finetune.errors import exit_process

POOLS = []  # kept alive, as torch keeps its compile pool (functools.cache): idle non-daemon workers at the end

def main():
    POOLS.append(concurrent.futures.ThreadPoolExecutor(2))
    print(POOLS[0].submit(sum, [1, 2]).result())
    sys.exit(0)

exit_process(main)
"""


def test_idle_pool_workers_do_not_keep_the_process_alive(tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(POOL)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "3"


GC = """
import gc
from finetune.errors import exit_process
exit_process(lambda: print(gc.get_threshold()[0]))
"""


def test_ft_processes_collect_garbage_less_often_than_python_by_default(tmp_path):
    from finetune.errors import GC_YOUNG_OBJECTS

    script = tmp_path / "gc_threshold.py"
    script.write_text(GC)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and int(done.stdout) == GC_YOUNG_OBJECTS > 700


@pytest.mark.slow
def test_a_compiled_job_exits_by_itself_with_a_cold_compile_cache(tmp_path):
    """The quickstart's case: compile on and an empty inductor cache leave torch's compile workers idle at the end."""
    cache = tmp_path / "inductor"
    done = ft_train(
        job(tmp_path, "run", steps=2),
        "--hardware",
        "cpu",
        "--set",
        "train.compile=true",
        env={"TORCHINDUCTOR_CACHE_DIR": str(cache)},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "result.json").exists()
    assert any(cache.iterdir())  # the cache was cold and inductor compiled into it


STUCK = """
import sys, threading, time
from finetune.errors import exit_process

def main():
    threading.Thread(target=time.sleep, args=(600,)).start()  # a non-daemon thread that would hold the exit
    print("written", flush=True)
    sys.exit(0)

exit_process(main)
"""


def test_ctrl_c_while_finishing_exits_130_without_a_traceback(tmp_path):
    import signal
    import time

    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # a terminal's default: an ignored SIGINT is inherited, and Python then installs no KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout.readline().strip() == b"written"
    time.sleep(0.5)  # inside the exit's thread join
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert b"Traceback" not in err and b"Ctrl-C" in err
