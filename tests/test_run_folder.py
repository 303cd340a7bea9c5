"""The run folder is the contract between `ft train` and its ranks: the Plan read back equals the Plan made,
ranks start from the folder alone (no CLI, no probe, no re-planning), and launch.txt is what ran.
The two-rank checks ride on the DDP run of tests/test_distributed.py (one torchrun run fewer)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.errors import FtError
from tests.helpers import REPO

EXAMPLES = sorted((REPO / "examples" / "yaml").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_plan_read_back_from_json_equals_the_plan(path):
    import re

    from finetune.plan.plan import Plan
    from finetune.workflow import compile_plan

    made = compile_plan(path, hardware=re.search(r"^# ft plan \S+ --hardware (\S+)$", path.read_text(), re.M).group(1))
    back = Plan.from_json(json.loads(json.dumps(made.to_json())))
    assert back == made
    assert back.to_json() == made.to_json()


def test_plan_fields_carry_what_downstream_used_to_re_derive():
    from finetune.config import loads
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts

    def planned(extra: str, hw: str = "8xH100-80GB", fmt: str = "chat"):
        config = loads(
            f"model: {{name: meta-llama/Llama-3.1-8B}}\ndata: {{datasets: [{{path: d.jsonl, format: {fmt}}}]}}\n"
            f"output: {{dir: run}}\n{extra}"
        )
        return plan(config, parse(hw), model_facts(config.model))

    q = planned("adapter: {type: qlora}\ndistributed: {backend: fsdp}\ntrain: {precision: bf16}")
    assert (q.quant_storage, q.loading, q.process_group) == ("bf16", "replica", True)
    f = planned("adapter: {type: full}\ndistributed: {backend: fsdp}")
    assert (f.quant_storage, f.loading, f.generation != "local") == (None, "meta", True)
    z = planned("adapter: {type: lora}\ndistributed: {backend: deepspeed, sharding: zero3}")
    assert z.loading == "partitioned"
    d = planned("adapter: {type: lora}\ndistributed: {backend: ddp}")
    assert (d.loading, d.generation, d.reference) == ("replica", "local", "none")
    dpo = planned("adapter: {type: full}\nmethod: {name: dpo}", fmt="preference")
    assert dpo.reference == "copy"
    lora_dpo = planned("adapter: {type: lora}\nmethod: {name: dpo, reference: precomputed}", fmt="preference")
    assert lora_dpo.reference == "precomputed"
    one = planned("adapter: {type: lora}", hw="1xH100-80GB")
    assert (one.process_group, one.launch[:3]) == (False, ("python", "-m", "finetune.rank"))


@pytest.mark.slow
def test_a_rank_without_a_plan_is_told_what_to_run(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "finetune.rank", str(tmp_path)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "config.yaml" in r.stderr or "plan.json" in r.stderr


def test_a_rank_imports_neither_libraries_before_it_needs_them_nor_the_planner():
    """Every rank of every job pays for what its start imports: `finetune.rank` alone loads no library (each comes with
    the step that uses it), and reading plan.json back loads the Plan, not the planner and its search."""
    code = (
        "import sys\n"
        "import finetune.rank\n"
        "heavy = ('torch', 'transformers', 'pydantic', 'yaml', 'rich', 'typer', 'matplotlib', 'datasets', 'pandas',"
        " 'peft', 'bitsandbytes', 'deepspeed')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "from finetune.plan.plan import Plan\n"
        "planning = ('finetune.plan.planner', 'finetune.plan.search', 'finetune.hardware')\n"
        "print(sorted(m for m in planning if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-2:] == ["[]", "[]"]


# ---------------------------------------------------------------- device discipline that the CPU can check
def test_rng_state_round_trips_through_weights_only_loading(tmp_path):
    import random

    import numpy as np

    from finetune.checkpoint import load_tensors, rng_state, set_rng_state

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(load_tensors(tmp_path / "rng.pt"))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], got[0]) and expected[1:] == got[1:]


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["FT_TEST_MARKER"]),))


def test_a_crafted_checkpoint_file_runs_no_code(tmp_path, monkeypatch):
    from finetune.checkpoint import load_tensors

    marker = tmp_path / "pwned"
    monkeypatch.setenv("FT_TEST_MARKER", str(marker))
    with open(tmp_path / "rng.pt", "wb") as f:
        pickle.dump({"python": _Payload()}, f, protocol=2)
    with pytest.raises(FtError, match="weights_only"):
        load_tensors(tmp_path / "rng.pt")
    assert not marker.exists()


def test_precomputed_reference_indexes_on_the_batch_device():
    from finetune.methods.dpo import Precomputed

    table = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = Precomputed(table)(None, {"rows": torch.tensor([2, 0], device="meta")}, None)  # stands in for the rank's GPU
    assert out.device.type == "meta" and out.shape == (4,)
    out = Precomputed(table)(None, {"rows": torch.tensor([2, 0])}, None)
    assert out.tolist() == [5.0, 1.0, 6.0, 2.0]


def test_bitsandbytes_optimizers_are_refused_under_fsdp_and_avoided_by_auto():
    from finetune.config import loads
    from finetune.errors import ConfigError, PlanError
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts

    base = (
        "model: {name: meta-llama/Llama-3.1-8B}\ndata: {datasets: [{path: d.jsonl, format: chat}]}\noutput: {dir: "
        "run}\nadapter: {type: full}\n"
    )
    with pytest.raises(ConfigError, match="train.optimizer") as e:
        loads(base + "train: {optimizer: paged_adamw_8bit}\ndistributed: {backend: fsdp}")
    assert "DTensor" in str(e.value) and "distributed.backend" in str(e.value)
    plain = loads(base)
    # what auto picks without the 8-bit optimizer
    assert plan(plain, parse("8xH100-80GB"), model_facts(plain.model)).backend == "fsdp"
    config = loads(base + "train: {optimizer: adamw_8bit}")
    try:
        assert plan(config, parse("8xH100-80GB"), model_facts(config.model)).backend != "fsdp"
    except PlanError:
        pass  # nothing else fits: refused at plan time, never a crash at the first optimizer step


# ---------------------------------------------------------------- what ft launch and Slurm leave, and --overwrite
def test_a_folder_holding_only_what_a_launch_left_is_no_run_and_overwrite_keeps_those_files(tmp_path):
    from finetune.artifacts.run import LOCK, looks_like_run, remove_run
    from finetune.resume import resume_point

    run = tmp_path / "run"
    run.mkdir()
    for name in ("job.sbatch", "slurm-41.out", "job-k8s.yaml"):  # ft launch's files, and the job's own Slurm log
        (run / name).write_text("x")
    assert not looks_like_run(run) and resume_point(run, True, explicit=False, overwrite=False) is None
    assert resume_point(run, False, explicit=False, overwrite=False) is None  # no --overwrite needed: no run yet
    assert remove_run(run, None) == [] and len(list(run.iterdir())) == 3  # --overwrite: nothing of a run to remove

    (run / ".ft-run").write_text("")
    for name in ("config.yaml", "metrics.jsonl", LOCK):
        (run / name).write_text("x")
    (run / "nccl-traces").mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(FtError, match="already holds a run.*--overwrite"):
        resume_point(run, False, explicit=False, overwrite=False)
    assert remove_run(run, None) == ["notes.txt"]  # what ft wrote is gone; the lock (held by the job) stays
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [LOCK, "job-k8s.yaml", "job.sbatch", "notes.txt", "slurm-41.out"]
    )

    other = tmp_path / "other"
    other.mkdir()
    (other / "slurm-1.out").write_text("")
    (other / "thesis.tex").write_text("")
    with pytest.raises(FtError, match="not empty and is not an ft run folder"):
        resume_point(other, True, explicit=False, overwrite=False)


def test_commands_that_replace_their_output_refuse_a_run_folder(tmp_path):
    from finetune.artifacts.run import refuse_replacing_run

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(FtError, match="--out .* is an ft run folder"):
        refuse_replacing_run(run, "--out")
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "model.safetensors").write_text("x")
    refuse_replacing_run(merged, "--out")  # an earlier output of the command may be replaced
    refuse_replacing_run(tmp_path / "new", "--out")
