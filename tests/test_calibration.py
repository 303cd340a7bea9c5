"""The memory estimate against published, measured peaks (tests/data/memory_calibration.yaml, with sources)."""

from __future__ import annotations

import pytest

from finetune.catalog import lookup
from finetune.errors import PlanError
from finetune.hardware import parse
from finetune.plan import plan
from tests import calibration

ROWS = calibration.rows()
# Each rank quantizes a 4-bit base in its own host RAM (or on its GPU) while loading; torchtune loads 405B as NF4
# shards (torchao under FSDP2), which ft cannot yet do: eight 203 GiB copies do not fit the node's RAM, so the planner
# rightly refuses it. strict: this fails once ft can load it.
NEEDS_SHARDED_4BIT_LOADING = {"torchtune-llama31-405b-qlora-8xa100"}


# Rows the estimate cannot bring within 30% from the settings the source states, and why.
OUTSIDE_30_PERCENT = {
    # at 2 x 2048 tokens the floor alone (NF4 shard 25 GiB, the FSDP2 root's bf16 embeddings and output gathered all
    # step 7.8 GiB, two NF4 layers 3.1 GiB, 126 checkpointed layer inputs 15.8 GiB) is above the 44.8 measured; at the
    # config's batch_size 1 the estimate is 52.6 GiB (+17%)
    "torchtune-llama31-405b-qlora-8xa100",
}


def test_estimate_error_on_published_runs_is_within_bounds():
    results = [calibration.compare(r) for r in ROWS]
    median, p90 = calibration.summary(results)
    table = "\n".join(f"{r.id}: measured {r.measured_gib:.1f}, estimated {r.estimated_gib:.1f}" for r in results)
    assert len(results) >= 30
    assert median <= 0.09, table
    assert p90 <= 0.18, table
    outside = {r.id for r in results if abs(r.error) > 0.30}
    assert outside <= OUTSIDE_30_PERCENT, table


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(r, marks=pytest.mark.xfail(strict=True, reason="needs sharded 4-bit loading"))
        if r["id"] in NEEDS_SHARDED_4BIT_LOADING
        else r
        for r in ROWS
    ],
    ids=[r["id"] for r in ROWS],
)
def test_no_published_run_is_refused_on_the_card_it_ran_on(row):
    try:
        p = plan(calibration.config_of(row), parse(row["gpu"]), lookup(row["model"]))
    except PlanError as e:
        pytest.fail(f"{row['id']} ran on {row['gpu']} but ft refuses it: {e}")
    assert p.micro_batch_size == row["settings"]["micro_batch_size"]
