"""Host memory of a CPU training process alone (finetune/distributed/hostmem.py keep_freed_memory): the buffers one
step frees are kept for the next, which allocates them again, instead of being given back and faulted in again."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings"
)

STEPS = """
import json, resource, sys, torch
from finetune.distributed import hostmem
if sys.argv[1] == "keep":
    assert hostmem.keep_freed_memory()
torch.set_num_threads(1)
def step():  # a training step's shape of allocation: a few large buffers, freed at its end, and many small ones
    big = [torch.ones(4 * 256 * 4096) for _ in range(3)]  # 16 MiB each, as a micro-batch's logits and their gradient
    small = [torch.ones(256 * 256) for _ in range(200)]
    return sum(float(t[0]) for t in big + small)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20))
"""


def _faults_per_step(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout)


def test_one_cpu_process_keeps_a_steps_freed_buffers_for_the_next_step():
    default, kept = _faults_per_step("default"), _faults_per_step("keep")
    print(f"\npage faults per step-like round: glibc's defaults {default:.0f}, kept {kept:.0f}")
    # a 16 MiB buffer is 4096 pages: at the defaults the heap's freed top goes back each round and is faulted in again
    # (measured 6.3k a round), kept it is reused (measured 0.6k: the small buffers' first touches)
    assert default > 4096 and kept < default / 5
