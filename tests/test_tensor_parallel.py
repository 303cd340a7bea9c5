"""Tensor parallelism (distributed/tp.py) composed with FSDP2 on a (dp × tp) mesh: the plan of a decoder layer, the
refusals, and (gloo, CPU) runs on 2 ranks (tp 2) and 4 ranks (dp 2 × tp 2) that must equal one process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from finetune.config.parallel_checks import tensor_parallel_problems
from finetune.distributed import mesh, tp
from finetune.distributed.runtime import Runtime
from finetune.errors import FtError
from tests.helpers import LORA, REPO, free_port, job, losses, train_here

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def _layer(kind: str, lora: bool = False):
    import transformers

    model = getattr(transformers, f"{kind}ForCausalLM")(getattr(transformers, f"{kind}Config")(**SHAPE))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    from finetune.distributed.fsdp import decoder_layers

    return decoder_layers(model)[0]


@pytest.mark.parametrize("kind", ["Llama", "Qwen2"])
@pytest.mark.parametrize("lora", [False, True])
def test_the_plan_covers_every_linear_and_norm_of_a_layer(kind, lora):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    layer = _layer(kind, lora)
    plan = tp.layer_plan(layer, kind.lower())
    linears = [n for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == (7 * 3 if lora else 7)
    for name in linears:
        projection = next(p for p in (*tp.COLUMN, *tp.ROW) if f".{p}" in f".{name}")
        column = projection in tp.COLUMN
        style = plan.get(name)
        if name.endswith(projection) or ".base_layer" in name:  # the projection itself: split like its kind
            assert isinstance(style, ColwiseParallel if column else RowwiseParallel), name
        elif ".lora_A." in name:  # whole beside a column-wise base, row-wise beside a row-wise one
            assert (style is None) if column else isinstance(style, RowwiseParallel), name
        else:  # lora_B: column-wise beside a column-wise base, whole beside a row-wise one
            assert isinstance(style, ColwiseParallel) if column else style.__class__.__name__ == "_Replicated", name
    norms = [n for n, _ in layer.named_children() if "norm" in n]
    assert norms and all(isinstance(plan[n], SequenceParallel) for n in norms)


def test_a_layer_of_another_shape_is_refused_naming_the_model_type():
    layer = _layer("Llama")
    layer.self_attn.extra = torch.nn.Linear(4, 4)  # a parameter the plan does not know
    with pytest.raises(FtError, match=r"distributed\.tensor_parallel.*llama decoder layer.*self_attn\.extra"):
        tp.layer_plan(layer, "llama")


def _facts(**changes):
    from finetune.catalog import resolve

    return dataclasses.replace(resolve("ft-tiny"), **changes)  # 4 heads, 2 KV heads, intermediate 384


@pytest.mark.parametrize(
    "tp_degree, changes, kwargs, constraint",
    [
        (2, {}, {"backend": "ddp"}, "composes with FSDP2 only"),
        (2, {}, {"backend": "deepspeed"}, "composes with FSDP2 only"),
        (2, {}, {"quantization": "nf4"}, "cannot split nf4 quantized weights"),
        (2, {}, {"quantization": "int8"}, "cannot split int8"),
        (4, {}, {"processes_per_node": 6}, "must divide the processes per node (6)"),
        (8, {}, {"processes_per_node": 8}, "must divide the model's attention heads (4)"),
        (4, {}, {"processes_per_node": 4}, "must divide the model's KV heads (2)"),
        (2, {"intermediate_size": 385}, {}, "must divide the model's MLP intermediate size (385)"),
        (2, {}, {"dora": True}, "DoRA"),
        (2, {}, {"sharding": "hybrid_shard"}, "hybrid_shard"),
        (2, {}, {"samples": True}, "GRPO"),
        (2, {}, {"stochastic_rounding": True}, "stochastic rounding"),
    ],
)
def test_refusals_name_the_key_and_the_constraint(tp_degree, changes, kwargs, constraint):
    args = {"backend": "fsdp", "processes_per_node": 8, **kwargs}
    problems = tensor_parallel_problems(_facts(**changes), tp_degree, **args)
    assert problems and all(p.startswith(f"{tp.KEY}: {tp_degree}") for p in problems)
    assert any(constraint in p for p in problems), problems


def test_a_supported_job_has_no_problems_and_tp_1_never_has():
    assert tensor_parallel_problems(_facts(), 2, backend="fsdp", processes_per_node=8, world_size=16) == []
    assert tensor_parallel_problems(_facts(), 1, backend="ddp", quantization="nf4", processes_per_node=3) == []


def test_ranks_of_one_block_share_their_rows_and_are_consecutive():
    world, tp_degree, cp = 8, 2, 2
    runtimes = [Runtime(rank=r, world_size=world).with_parallel(tp_degree, cp) for r in range(world)]
    assert [rt.data_rank for rt in runtimes] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {rt.data_world for rt in runtimes} == {2} == {mesh.data_world(world, tp_degree, cp)}
    assert [rt.leads_replicas for rt in runtimes] == [True, False, False, False] * 2
    assert [mesh.data_rank(r, tp_degree, cp) for r in range(world)] == [rt.data_rank for rt in runtimes]
    assert Runtime().with_parallel(2, 1) == Runtime()  # one process: nothing to split
    assert mesh.device_mesh("cpu", 4) is None  # no tp, no cp: FSDP2 makes its own mesh


# ---------------------------------------------------------------- on gloo ranks
FAMILIES = ["Llama", "Qwen2", "Mistral", "Gemma", "Gemma2"]


def _torchrun(processes: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )


def _tp_folder(tmp_path, name: str, world: int, tp_degree: int, *overrides: str, config_path=None):
    """The tiny job (tests/helpers.py `job`) planned for FSDP2 on `world` CPU processes with
    distributed.tensor_parallel set, and its run folder written (plan.json) as ft train writes it before it starts
    the ranks."""
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan as make_plan
    from finetune.workflow import model_facts, write_run_folder

    sets = ["distributed.backend=fsdp", f"distributed.tensor_parallel={tp_degree}", *overrides[1::2]]  # --set K=V
    config = load(config_path or job(tmp_path, name), sets)
    p = make_plan(config, parse(f"cpu:{world}"), model_facts(config.model))
    assert (p.backend, p.world_size, p.tensor_parallel, p.data_parallel) == ("fsdp", world, tp_degree, world // 2)
    run = tmp_path / name
    run.mkdir(exist_ok=True)
    write_run_folder(run, config, p, prepare(config), ["(test)"])
    return run


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Every multi-process job of this file in two torchrun launches. 2 ranks (tests/scripts/tp_probe.py): each
    family split against its whole model, then from their run folders, as ft train starts them, one after another:
    full fine-tuning (tp 2, a checkpoint at step 3), a copy of that folder resumed from its step-3 checkpoint, LoRA,
    DPO with a precomputed reference. 4 ranks (python -m finetune.rank): full fine-tuning on dp 2 x tp 2. DPO also in
    one process (this one)."""
    from finetune.tiny import preference_records, write_jsonl

    root = tmp_path_factory.mktemp("tp")
    probe = root / "probe"
    probe.mkdir()
    full = {
        world: _tp_folder(root / f"world{world}", "tp", world, 2, "--set", "output.save_steps=3") for world in (2, 4)
    }
    lora = _tp_folder(root / "lora", "tp-lora", 2, 2, *LORA)
    dpo_dir = root / "dpo"
    dpo_dir.mkdir()
    data = write_jsonl(preference_records(32, seed=3), dpo_dir / "pairs.jsonl")
    config = dpo_dir / "dpo.yaml"
    config.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: preference}}], seq_len: 48, cache_dir: {dpo_dir / "cache"}}}
method: {{name: dpo, reference: precomputed, beta: 0.5}}
adapter: {{type: full}}
train: {{global_batch_size: 8, micro_batch_size: 4, max_steps: 3, lr: 1.0e-3, warmup_steps: 1}}
output: {{dir: {dpo_dir / "one"}, log_steps: 1, save_steps: 0}}
""")
    train_here(config)
    dpo = _tp_folder(dpo_dir, "dpo-tp", 2, 2, "--set", f"output.dir={dpo_dir / 'dpo-tp'}", config_path=config)
    resumed = root / "world2" / "tp-resumed"
    step3 = full[2] / "checkpoints" / "step-00000003"
    runs = [f"run={full[2]}", f"run={resumed}@resume={step3}", f"run={lora}", f"run={dpo}"]
    r = _torchrun(2, [str(REPO / "tests" / "scripts" / "tp_probe.py"), str(probe), *FAMILIES, *runs])
    assert r.returncode == 0, r.stderr[-4000:]
    r = _torchrun(4, ["-m", "finetune.rank", str(full[4])])
    assert r.returncode == 0, r.stderr[-4000:]
    return {"probe": probe, "full": full, "resumed": resumed, "lora": lora, "dpo": dpo, "dpo_one": dpo_dir / "one"}


@pytest.mark.slow
def test_each_family_split_over_two_ranks_computes_what_one_process_does(tp_runs):
    """Logits, loss and every gradient (made whole), with and without LoRA, for the catalog's families."""
    families = FAMILIES
    for rank in (0, 1):
        report = json.loads((tp_runs["probe"] / f"probe-rank{rank}.json").read_text())
        assert sorted(report) == sorted(f"{k}-{m}" for k in families for m in ("full", "lora"))
        for name, case in report.items():
            assert case["loss"][0] == pytest.approx(case["loss"][1], rel=1e-6), name
            assert case["logits"] < 1e-5, name
            assert case["grad_errors"] and max(case["grad_errors"].values()) < 1e-5, name
            assert case["same_trainable"], name  # the norms of a LoRA job stay frozen once split
            assert case["sharded"], name
            if name.endswith("lora"):  # every adapter matrix has its gradient
                assert sum(".lora_" in n for n in case["grad_errors"]) == 2 * 7 * 2, name


def _logits(folder, lora_base=None):
    """A final/ (or consolidated) model's logits on fixed tokens, loaded in this one process."""
    from transformers import AutoModelForCausalLM

    if lora_base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(lora_base)), str(folder))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = torch.arange(3, 43).view(2, 20)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])  # tp 2 alone, and dp 2 × tp 2
def test_full_fine_tuning_over_tp_matches_one_process_and_resumes(tmp_path, one_process, tp_runs, world):
    """Per-step losses (6 steps, 2 micro-batches per rank and step) equal one process's; the final model reloads in
    one process with one process's logits; (tp 2) the checkpoint of step 3 consolidates in one process to one
    process's, and a run resumed from it continues with the uninterrupted run's losses."""
    run = tp_runs["full"][world]
    plan = json.loads((run / "plan.json").read_text())
    assert (plan["backend"], plan["world_size"], plan["tensor_parallel"]) == ("fsdp", world, 2)
    a, b = losses(one_process), losses(run)
    assert len(a) == len(b) == 6 and a[-1] < a[0]
    assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    one = [json.loads(line) for line in (one_process / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in rows if "tokens" in r] == [r["tokens"] for r in one if "tokens" in r]  # once each
    assert [r["grad_norm"] for r in rows if "grad_norm" in r] == pytest.approx(
        [r["grad_norm"] for r in one if "grad_norm" in r], rel=1e-4
    )
    assert torch.allclose(_logits(run / "final"), _logits(one_process / "final"), atol=1e-4)
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(run / "checkpoints" / "step-00000003" / "dcp")).read_metadata()
    o_proj = next(v for k, v in saved.state_dict_metadata.items() if k.endswith("layers.0.self_attn.o_proj.weight"))
    assert {c.offsets[1] for c in o_proj.chunks} == {0, 64}  # split row-wise: the ranks of a tp group hold halves
    if world != 2:
        return
    from finetune.consolidate import consolidate

    mine = consolidate(run, step=3, out=tmp_path / "c-tp")
    theirs = consolidate(one_process, step=3, out=tmp_path / "c-one")
    assert torch.allclose(_logits(mine), _logits(theirs), atol=1e-4)
    # steps 4-6 again, from the checkpoint (in a copy of the run folder taken after the run)
    assert losses(tp_runs["resumed"]) == pytest.approx(b, rel=1e-5)


@pytest.mark.slow
def test_lora_over_tp_matches_one_process(one_process_lora, tp_runs):
    """LoRA (adapter matrices split with their projections): losses equal one process's, and the saved adapter
    reloads on the base in one process with one process's logits. (The 2-D mesh, dp 2 x tp 2, is the full fine-tuning
    test's: LoRA adds nothing to the data-parallel side of it.)"""
    run = tp_runs["lora"]
    a, b = losses(one_process_lora), losses(run)
    assert len(a) == len(b) == 6 and a[-1] < a[0]
    assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
    from finetune.config import load
    from finetune.models import model_path

    base = model_path(load(run / "config.yaml").model)
    assert torch.allclose(
        _logits(run / "final", lora_base=base), _logits(one_process_lora / "final", lora_base=base), atol=1e-4
    )


@pytest.mark.slow
def test_dpo_with_a_precomputed_reference_over_tp_matches_one_process(tp_runs):
    """The ranks of a tp group score the same reference rows (each row counted once in the summed table) and train on
    the same pairs: losses equal one process's."""
    a, b = losses(tp_runs["dpo_one"]), losses(tp_runs["dpo"])
    assert len(a) == len(b) == 3 and a[0] != a[-1]
    assert b == pytest.approx(a, rel=1e-4, abs=1e-5)
