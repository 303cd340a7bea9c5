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
        # LoRA: its resident peak holds 0.5-0.7 GiB of glibc's heap that no tensor uses (free bytes between live
        # buffers, mallinfo2's fordblks at the peak; 0.25 GiB with full fine-tuning): one CPU process keeps the
        # buffers a step frees, up to 32 MiB, in the heap for the next step (distributed/hostmem.py
        # keep_freed_memory), and LoRA's adapter-sized temporaries leave more of it between live ones. The tensors
        # at the peak are the same 0.75x of the estimate as full fine-tuning's, which the estimate does not model
        # past that (it depends on the order of the step's allocations, not on the setup). Measured 0.77-0.81 since
        # the plain loss's logits count the trained positions only (0.84-0.87 when they counted every position).
        low = 0.7 if adapter == "lora" else 0.8
        assert low <= ratio <= 1.25, (adapter, name, d["breakdown"])
    plain = measured["full", "plain"]
    for name in SAVERS.keys() - {"plain"}:  # each saver saves memory, measured, where the planner says it does
        if measured["full", name]["estimated"] < plain["estimated"]:
            assert measured["full", name]["measured"] < plain["measured"], name
    # the plain loss holds the logits of the trained positions only (46% of a row here), fewer than the chunked loss's
    # chunk (half a micro-batch): the chunked loss saves nothing on these rows, and the planner says so
    assert measured["full", "chunked loss"]["estimated"] > plain["estimated"]
