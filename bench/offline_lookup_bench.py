"""Seconds `ft plan` takes to answer for a model name it cannot find, on a machine whose hub endpoint does not
resolve (cluster compute nodes often have no hub access): ft asks once, without huggingface_hub's retries.

    python bench/offline_lookup_bench.py [--rounds 3]

Prints the seconds of each round and their median; huggingface_hub's own path (five retries) took about 27 s here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = """model: {{name: some-org/no-such-model-xyz}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64}}
adapter: {{type: lora}}
train: {{global_batch_size: 8, max_steps: 10}}
output: {{dir: {out}}}
"""


def one_round(folder: Path) -> float:
    job = folder / "job.yaml"
    job.write_text(JOB.format(data=REPO / "examples/data/arithmetic.jsonl", out=folder / "run"))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(
        HF_ENDPOINT="http://ft-no-such-host.invalid", HF_HOME=str(folder / "hf"), HF_HUB_CACHE=str(folder / "hub")
    )
    start = time.monotonic()
    cmd = [sys.executable, "-m", "finetune", "plan", str(job), "--hardware", "cpu"]
    subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            seconds.append(one_round(Path(tmp)))
        print(f"round {i + 1}: {seconds[-1]:.2f} s")
    print(f"median: {statistics.median(seconds):.2f} s for ft plan of an unknown model without the hub")


if __name__ == "__main__":
    main()
