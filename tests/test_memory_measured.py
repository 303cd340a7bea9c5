"""The planner's memory estimate against the memory a real (CPU) training run adds, each in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # each test trains in a process of its own


def probe(jobs: list[tuple[str, str]]) -> list[dict]:
    """tests/scripts/memory_probe.py: each (adapter, train keys) job trained in a child of one fresh process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    script = str(REPO / "tests" / "scripts" / "memory_probe.py")
    r = subprocess.run(
        [sys.executable, script, *(f"{adapter}|{keys}" for adapter, keys in jobs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    found = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(d["adapter"], d["keys"]) for d in found] == jobs
    return found


# each job trains in a process of its own (peak RSS only grows), forked after the imports; they run side by side.
# Selective checkpointing's saving is measured in tests/test_activation_savers.py (saved-tensor bytes fall as more
# layers recompute).
SAVERS = {
    "plain": "",
    "chunked loss": "loss_implementation: chunked",
    "bf16-pure": "precision: bf16-pure",
}


def test_estimate_is_within_band_of_measured_training_memory():
    keys = [("full", name) for name in SAVERS] + [("lora", "plain")]
    found = probe([(adapter, SAVERS[name]) for adapter, name in keys])
    measured = dict(zip(keys, found))
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
