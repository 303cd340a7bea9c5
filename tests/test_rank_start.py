"""Ranks meet at the launcher's store before the process group starts (distributed/runtime.py _all_started), with a
startup wait of their own: a job's short collective timeout (distributed.timeout_minutes) does not fail ranks that
start seconds apart, and a rank that never comes is named."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from finetune.distributed import runtime
from finetune.errors import LostPeers
from tests.helpers import free_port


@pytest.fixture
def launcher_store(monkeypatch):
    """A store served as torchrun's agent serves its workers' (TORCHELASTIC_USE_AGENT_STORE)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return store


def test_a_rank_that_starts_late_is_waited_for(launcher_store):
    done = {}

    def rank(r: int, delay: float):
        time.sleep(delay)
        started = time.monotonic()
        runtime._all_started(r, 2, minutes=0.1)
        done[r] = time.monotonic() - started

    late = threading.Thread(target=rank, args=(1, 1.5))
    late.start()
    rank(0, 0.0)
    late.join()
    assert sorted(done) == [0, 1]
    assert done[0] >= 1.0  # rank 0 waited for rank 1, then went on
    assert launcher_store.check(["ft/started/0/0", "ft/started/0/1"])


def test_a_rank_that_never_starts_is_named(launcher_store):
    started = time.monotonic()
    with pytest.raises(LostPeers, match=r"rank 1 waited 0.02 min for the job's 2 ranks .* \(ranks \[0\]\)"):
        runtime._all_started(1, 2, minutes=0.02)
    assert 1.0 <= time.monotonic() - started < 30
    assert LostPeers.exit_code == 134  # retryable: a scheduler restarts the job, which resumes


def test_a_restarted_round_does_not_count_the_ranks_of_the_round_before(launcher_store, monkeypatch):
    launcher_store.set("ft/started/0/0", "1")  # round 0's rank 0, since restarted by torchrun
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(LostPeers, match=r"\(ranks \[0\]\)"):
        runtime._all_started(1, 2, minutes=0.02)
