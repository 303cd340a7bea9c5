"""The planner's memory estimate against the memory a real (CPU) training run adds, in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # each test trains in a process of its own


def probe(adapter: str, keys: str = "") -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = str(REPO / "tests" / "scripts" / "memory_probe.py")
    return subprocess.Popen(
        [sys.executable, script, adapter, keys],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


# each probe trains in a fresh process (peak RSS only grows); they run side by side. Selective checkpointing's saving
# is measured in tests/test_activation_savers.py (saved-tensor bytes fall as more layers recompute).
SAVERS = {
    "plain": "",
    "chunked loss": "loss_implementation: chunked",
    "bf16-pure": "precision: bf16-pure",
}


def test_estimate_is_within_band_of_measured_training_memory():
    runs = {("full", name): probe("full", keys) for name, keys in SAVERS.items()}
    runs["lora", "plain"] = probe("lora")
    measured = {key: result(p) for key, p in runs.items()}
    for (adapter, name), d in measured.items():
        ratio = d["estimated"] / d["measured"]
        print(
            f"{adapter}, {name}: estimated {d['estimated'] / 2**20:.0f} MiB, measured {d['measured'] / 2**20:.0f} MiB, "
            f"ratio {ratio:.2f}"
        )
        assert 0.8 <= ratio <= 1.25, (adapter, name, d["breakdown"])
    plain = measured["full", "plain"]["measured"]
    for name in SAVERS.keys() - {"plain"}:  # each saver saves memory, measured, as the planner says it does
        assert measured["full", name]["measured"] < plain, name
