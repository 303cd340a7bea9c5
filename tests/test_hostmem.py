"""Host memory of a CPU training process alone (finetune/distributed/hostmem.py keep_freed_memory): the buffers one
step frees stay in the process's heap for the next step, which allocates them again, instead of being given back to
the system and faulted in again (bench/peers.py measures what that saves a step)."""

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

FREED = """
import json, os, sys, torch
from finetune.distributed import hostmem
if sys.argv[1] == "keep":
    assert hostmem.keep_freed_memory()
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
logits = torch.ones(4 * 256 * 4096)  # 16 MiB, a micro-batch's logits, written
held = rss_mib()
del logits
print(json.dumps(held - rss_mib()))
"""


def _given_back_mib(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", FREED, mode], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_one_cpu_process_keeps_a_steps_freed_buffers_for_the_next_step():
    default, kept = _given_back_mib("default"), _given_back_mib("keep")
    print(f"\nMiB given back when a 16 MiB buffer is freed: glibc's defaults {default:.1f}, kept {kept:.1f}")
    # glibc maps a process's first large buffer on its own and unmaps it when freed: the next step faults it in again
    assert default >= 15 and kept < 1
