"""bench/gpu_bench.py scaling (what scripts/gpu-check.sh measures on GPUs) run end to end on CPU: one process against
two gloo processes (`--hardware cpu` against `cpu:2`), the measured and the predicted scaling efficiency side by side.
The CPU figures say nothing about GPUs; the pipeline (the runs, the plan's figures, the JSON, the report) is what is
checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def _bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_bench.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        timeout=timeout,
    )


def test_one_device_is_skipped_and_says_so(tmp_path):
    out = tmp_path / "scaling.json"
    r = _bench("scaling", "--model", str(tmp_path / "model"), "--hardware", "cpu", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "scaling: skipped (--hardware cpu describes 1 device: the scaling check needs at least 2)" in r.stdout
    assert json.loads(out.read_text())["skipped"]
    assert not (tmp_path / "model").exists()  # nothing built for a skipped check
    r = _bench("summary", "--scaling", str(out))
    assert r.returncode == 0 and "scaling: skipped" in r.stdout


@pytest.mark.slow
def test_two_cpu_processes_against_one_give_measured_and_predicted_efficiency(tmp_path):
    out, work = tmp_path / "scaling.json", tmp_path / "work"
    args = [
        "--hardware",
        "cpu:2",
        "--size",
        "small",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--seq-len",
        "64",
        "--micro",
        "1",
    ]
    r = _bench("scaling", "--model", str(tmp_path / "model"), "--work", str(work), "--json", str(out), *args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    b = json.loads(out.read_text())
    assert b["problems"] == [] and b["devices"] == 2
    one, two = b["runs"]
    assert (one["devices"], one["world_size"], one["backend"]) == (1, 1, "single")
    assert (two["devices"], two["world_size"]) == (2, 2) and two["backend"] != "single"
    for run in (one, two):  # the same work per device: one micro-batch of 64 tokens a step, no accumulation
        assert (run["micro_batch_size"], run["gradient_accumulation_steps"], run["timed_steps"]) == (1, 1, 3)
    assert two["tokens_per_step"] == pytest.approx(2 * one["tokens_per_step"], rel=0.05)
    assert (
        b["measured_efficiency"] > 0
    )  # a measured figure, not a bound: the benchmark reports it, the suite does not time
    assert b["measured_efficiency"] == pytest.approx(two["tokens_per_s"] / (2 * one["tokens_per_s"]))
    assert 0 < b["predicted_efficiency"] <= 1.5
    plan = json.loads((work / "run-2" / "plan.json").read_text())  # the 2-process run's own prediction
    assert b["predicted_efficiency"] == plan["scaling"]["efficiency"]
    assert b["predicted"]["communication_seconds"] == plan["scaling"]["communication_seconds"] > 0
    for text in (r.stdout, _bench("summary", "--scaling", str(out)).stdout):
        assert f"measured efficiency:  {b['measured_efficiency']:7.1%}" in text
        assert f"predicted efficiency: {b['predicted_efficiency']:7.1%}" in text
