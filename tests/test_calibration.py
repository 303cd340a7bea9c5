"""The memory estimate against published, measured peaks (tests/data/memory_calibration.yaml, with sources)."""

from __future__ import annotations

import pytest

from finetune.catalog import lookup
from finetune.errors import PlanError
from finetune.hardware import parse
from finetune.plan import plan
from tests import calibration

ROWS = calibration.rows()
# ft loads a 4-bit base as a whole quantized copy on each GPU (bitsandbytes quantizes while loading); these runs load
# it shard by shard (torchao NF4 under FSDP2, or Answer.AI's layer-by-layer loading), which ft cannot yet do, so the
# planner rightly refuses them: the load alone does not fit. strict: this fails once ft can load them.
NEEDS_SHARDED_4BIT_LOADING = {
    "torchtune-llama31-405b-qlora-8xa100",
    "fsdpqlora-llama2-70b-qlora-offload-bs2-2x3090",
    "peft-llama2-70b-qlora-fsdp-offload-2x24gb",
}


def test_estimate_error_on_published_runs_is_within_bounds():
    results = [calibration.compare(r) for r in ROWS]
    median, p90 = calibration.summary(results)
    table = "\n".join(f"{r.id}: measured {r.measured_gib:.1f}, estimated {r.estimated_gib:.1f}" for r in results)
    assert len(results) >= 30
    assert median <= 0.15, table
    assert p90 <= 0.30, table


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
