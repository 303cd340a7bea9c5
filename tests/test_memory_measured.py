"""The planner's memory estimate against the memory a real (CPU) training run adds, in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # each test trains in a process of its own


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_estimate_is_within_band_of_measured_training_memory(adapter):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / "memory_probe.py"), adapter],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    ratio = d["estimated"] / d["measured"]
    print(
        f"{adapter}: estimated {d['estimated'] / 2**20:.0f} MiB, measured {d['measured'] / 2**20:.0f} MiB, ratio "
        f"{ratio:.2f}"
    )
    assert 0.7 <= ratio <= 1.4
