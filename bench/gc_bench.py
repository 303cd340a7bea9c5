"""The CPU time of a short `ft train` with the garbage collector's first threshold at Python's default (700) and at
ft's (finetune/errors.py GC_YOUNG_OBJECTS), side by side.

The job: the quickstart's (ft-tiny, full fine-tuning, the arithmetic data) for a few steps, one process, one thread,
a fresh run folder each time and the data cache warm (prepared once before the rounds). Each run is its own process
(`ft train` as a user starts it, with the threshold set before ft's code runs); the figure is the process's CPU
time (user + system), which a busy machine inflates much less than the wall-clock. Rounds alternate the two
settings so that the machine's noise hits them alike; the table shows each round and the medians.

    python bench/gc_bench.py [--rounds 5] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = (  # ft's own entry point, with the threshold it sets replaced by the one given
    "import sys, finetune.errors as e; e.GC_YOUNG_OBJECTS = int(sys.argv.pop(1)); "
    "from finetune.cli import entry; entry()"
)


def job(folder: Path, steps: int) -> Path:
    data = REPO / "examples" / "data" / "arithmetic.jsonl"
    text = (
        "model: {name: ft-tiny}\n"
        f"data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64, packing: false}}\n"
        "method: {name: sft}\nadapter: {type: full}\n"
        f"train: {{global_batch_size: 8, lr: 2.0e-3, max_steps: {steps}}}\n"
        f"output: {{dir: {folder / 'run'}, save_steps: 0, log_steps: 1}}\n"
    )
    path = folder / "job.yaml"
    path.write_text(text)
    return path


def cpu_seconds(config: Path, threshold: int) -> float:
    """CPU time (user + system) of one `ft train` process with this first GC threshold."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", CHILD, str(threshold), "train", str(config), "--hardware", "cpu", "--overwrite"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    from finetune.errors import GC_YOUNG_OBJECTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    settings = (700, GC_YOUNG_OBJECTS)
    with tempfile.TemporaryDirectory() as tmp:
        config = job(Path(tmp), args.steps)
        cpu_seconds(config, GC_YOUNG_OBJECTS)  # prepares the data cache and builds ft-tiny once
        rows = []
        for i in range(args.rounds):
            order = settings if i % 2 == 0 else settings[::-1]
            got = {t: cpu_seconds(config, t) for t in order}
            rows.append(got)
            print(f"round {i + 1}: " + "  ".join(f"threshold {t}: {got[t]:.2f} CPU-s" for t in settings), flush=True)
    med = {t: statistics.median(r[t] for r in rows) for t in settings}
    print(f"\n| first GC threshold | CPU-s per `ft train` (median of {args.rounds}) | ratio |")
    print("|---|---|---|")
    for t in settings:
        print(f"| {t} | {med[t]:.2f} | {med[t] / med[700]:.3f} |")


if __name__ == "__main__":
    main()
