"""What the benchmark scripts share: run `ft train` on a config as a user would, and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train_metrics(config: Path, hardware: str, run_dir: Path) -> list[dict]:
    """metrics.jsonl rows of `ft train CONFIG --hardware HARDWARE` (one thread per process; stops on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "train", str(config), "--hardware", hardware],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
