"""Expert parallelism (distributed/ep.py, plan/expert_parallel.py): the rules and the planner's choice with its memory
and traffic, fused experts read from per-expert checkpoints (finetune/conversions.py), and (gloo, CPU) runs on 2
ranks with each MoE layer's experts split over them that must equal one process.

The 2-rank jobs turn the router's load-balancing loss off (train.router_aux_loss_coef: 0): the comparisons are of the
expert split, and under FSDP2, with or without it, methods/router.py looks its family's loss up by the wrapped class's
module (FSDP2's), finds none and adds nothing, where one process adds it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.config.parallel_checks import expert_parallel_problems
from finetune.distributed import ep
from finetune.errors import FtError, PlanError
from tests.helpers import REPO, free_port, losses, metric_rows, tiny_moe, train_here

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")
ATTENTION_LORA = "adapter={type: lora, r: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj]}"


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    """A tiny model folder of each family (tests/helpers.py tiny_moe) and the arithmetic rows the jobs train on."""
    from finetune.tiny import arithmetic_records, write_jsonl

    root = tmp_path_factory.mktemp("moe")
    out = {kind: tiny_moe(root / kind, kind) for kind in FAMILIES}
    out["data"] = write_jsonl(arithmetic_records(128, seed=7), root / "d.jsonl")
    return out


def _job(tmp_path, model, data, name: str) -> Path:
    """6 steps of 8 rows (micro-batches of 2), a checkpoint at step 3, no load-balancing loss (module docstring)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 48, cache_dir: {tmp_path / "cache"}}}
adapter: {{type: full}}
train: {{global_batch_size: 8, micro_batch_size: 2, max_steps: 6, lr: 3.0e-3, warmup_steps: 1, router_aux_loss_coef: 0}}
output: {{dir: {tmp_path / name}, log_steps: 1, save_steps: 3}}
""")
    return path


def _plan(config_path, hardware: str, *sets: str):
    from finetune.config import load
    from finetune.hardware import parse
    from finetune.plan import plan as make_plan
    from finetune.workflow import model_facts

    config = load(str(config_path), list(sets))
    return make_plan(config, parse(hardware), model_facts(config.model))


# ---------------------------------------------------------------- the rules
@pytest.mark.parametrize(
    "facts, degree, kwargs, constraint",
    [
        (None, 2, {"backend": "ddp"}, "composes with FSDP2 only"),
        (None, 2, {"backend": "deepspeed"}, "composes with FSDP2 only"),
        (None, 4, {"world_size": 6}, "must divide the number of processes (6)"),
        (None, 2, {"quantization": "nf4"}, "nf4 quantized base"),
        (None, 2, {"tensor_parallel": 2}, "tensor_parallel"),
        (None, 2, {"context_parallel": 2}, "context_parallel"),
        (None, 2, {"sharding": "hybrid_shard"}, "hybrid_shard"),
        (None, 2, {"offload": "all"}, "offload: all"),
        (None, 2, {"lora_on_experts": True}, "LoRA adapters of the routed experts"),
        (None, 2, {"samples": True}, "sample during training"),
        (None, 2, {"compile": True}, "train.compile: false"),
        ({"model_type": "llama", "num_experts": 0}, 2, {}, "no mixture-of-experts layers"),
        ({"model_type": "qwen3_moe", "num_experts": 6}, 4, {"world_size": 8}, "must divide the model's 6 experts"),
        ({"model_type": "llama4_text", "num_experts": 16}, 2, {}, "no expert-parallel plan"),
    ],
)
def test_refusals_name_the_key_the_reason_and_the_fix(facts, degree, kwargs, constraint):
    from types import SimpleNamespace

    args = {"backend": "fsdp", "world_size": 8, **kwargs}
    problems = expert_parallel_problems(SimpleNamespace(**facts) if facts else None, degree, **args)
    assert problems and all(p.startswith(f"{ep.KEY}: {degree}") for p in problems), problems
    assert any(constraint in p for p in problems), problems
    assert all("set " in p or "choose" in p or "use " in p for p in problems), problems  # each names its fix


def test_a_supported_job_has_no_problems_and_degree_1_never_has():
    from types import SimpleNamespace

    qwen = SimpleNamespace(model_type="qwen3_moe", num_experts=128)
    assert expert_parallel_problems(qwen, 8, backend="fsdp", world_size=16) == []
    assert expert_parallel_problems(None, 1, backend="ddp", world_size=3, quantization="nf4", samples=True) == []


@pytest.mark.parametrize(
    "model, hardware, sets, constraint",
    [
        ("ft-tiny", "cpu:2", [], "no mixture-of-experts layers"),
        ("qwen3_moe", "cpu:2", ["distributed.backend=ddp"], "composes with FSDP2 only"),
        ("qwen3_moe", "cpu:2", ["distributed.backend=deepspeed"], "composes with FSDP2 only"),
        ("qwen3_moe", "cpu:2", ["adapter={type: qlora, r: 8, alpha: 16, dropout: 0.0}"], "nf4 quantized base"),
        ("qwen3_moe", "cpu:2", ["adapter={type: lora, r: 8, alpha: 16, dropout: 0.0}"], "LoRA adapters of the routed"),
        ("qwen3_moe", "cpu:8", ["distributed.expert_parallel=8"], "must divide the model's 4 experts"),
        ("qwen3_moe", "cpu:2", ["distributed.expert_parallel=4"], "must divide the number of processes (2)"),
        ("qwen3_moe", "cpu:2", ["train.compile=true"], "train.compile"),
    ],
)
def test_a_job_it_cannot_run_is_refused_when_planned(tmp_path, moe, model, hardware, sets, constraint):
    """Refused by `ft plan` (before any process starts), naming the key, the reason and the fix."""
    job = _job(tmp_path, moe.get(model, model), moe["data"], "job")
    with pytest.raises(PlanError) as refused:
        _plan(job, hardware, "distributed.expert_parallel=2", *sets)
    assert constraint in str(refused.value), str(refused.value)
    assert "expert_parallel" in str(refused.value) or "train.compile" in str(refused.value)


def test_an_explicit_degree_plans_fsdp2_with_its_memory_and_traffic(tmp_path, moe):
    from finetune.plan.comm import EXPERT_PARALLEL
    from finetune.plan.memory import EXPERT_DISPATCH
    from finetune.plan.plan import Plan

    p = _plan(_job(tmp_path, moe["qwen3_moe"], moe["data"], "job"), "cpu:2", "distributed.expert_parallel=2")
    assert (p.backend, p.sharding, p.quantization, p.expert_parallel, p.world_size) == (
        "fsdp",
        "full_shard",
        "none",
        2,
        2,
    )
    assert "expert_parallel: 2 runs under FSDP2" in p.decision("backend").reason  # why auto chose FSDP2 here
    chosen = p.decision("expert_parallel")
    assert chosen.source == "config" and "4 experts per layer over 2 ranks (2 each)" in chosen.reason
    assert p.communication[EXPERT_PARALLEL] > 0 and p.estimate.device[EXPERT_DISPATCH] > 0
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))).expert_parallel == 2  # what the ranks read


def test_auto_splits_the_experts_on_gpus_where_it_moves_fewer_bytes(tmp_path, moe):
    """Qwen3-30B-A3B (128 experts, top-8) on 8 GPUs: with 2 sequences of 1024 tokens per rank the routed tokens are
    fewer bytes than FSDP2's gathers of every expert (split 8 ways); with 8 of 4096 they are more (FSDP2 alone). On
    CPUs and for dense models auto keeps 1, saying why."""
    job = tmp_path / "big.yaml"
    job.write_text(f"""
model: {{name: Qwen/Qwen3-30B-A3B}}
data: {{datasets: [{{path: {moe["data"]}, format: chat}}], seq_len: 1024}}
adapter: {{type: full}}
train: {{global_batch_size: 16, max_steps: 1000}}
output: {{dir: {tmp_path / "big"}}}
""")
    few = _plan(job, "8xH100-80GB")
    assert few.expert_parallel == 8 and "communicates less than FSDP2 alone" in few.decision("expert_parallel").reason
    many = _plan(job, "8xH100-80GB", "data.seq_len=4096", "train.global_batch_size=64")
    assert many.expert_parallel == 1 and "FSDP2 alone communicates less" in many.decision("expert_parallel").reason
    assert few.estimate.device_bytes < _plan(job, "8xH100-80GB", "distributed.expert_parallel=1").estimate.device_bytes
    cpu = _plan(_job(tmp_path, moe["qwen3_moe"], moe["data"], "job"), "cpu:2")
    assert cpu.expert_parallel == 1 and "CPU" in cpu.decision("expert_parallel").reason
    dense = _plan(_job(tmp_path, "ft-tiny", moe["data"], "dense"), "2xH100-80GB")
    assert dense.expert_parallel == 1 and "dense model" in dense.decision("expert_parallel").reason


def test_memory_and_traffic_count_what_the_split_changes():
    """Per rank: the gathered experts shrink to 1/ep (twice in flight), the routed tokens' second copy is held, and
    FSDP2's bytes for the experts give way to the all-to-all of t·k·h values, 4 per layer (no recomputation)."""
    from finetune.catalog import resolve
    from finetune.plan.comm import EXPERT_PARALLEL, expert_parallel_traffic
    from finetune.plan.memory import EXPERT_DISPATCH, Setup, estimate

    m = resolve("Qwen/Qwen3-30B-A3B")
    s = Setup("full", "none", "bf16", "adamw_torch", 2, 1024, False, sharding="full_shard", shard_size=8)
    one, split = estimate(m, s), estimate(m, dataclasses.replace(s, expert_parallel=8))
    tokens_k_h = 2 * 1024 * m.experts_per_token * m.hidden_size
    saved = one.device["gathered layers"] - split.device["gathered layers"]
    assert saved == pytest.approx(2 * m.expert_params / m.num_layers * 2 * 7 / 8, rel=1e-6)
    assert split.device[EXPERT_DISPATCH] == 2 * tokens_k_h * 2
    step = {"all-gather parameters": 100.0, "reduce-scatter gradients": 50.0}
    moved = expert_parallel_traffic(step, 16, 8, 8, (0.9, 0.9), 2048, m.hidden_size, 8, m.num_layers, 0, 2, 1)
    kept = (1 / 2) / (8 * 15 / 16)  # the experts' bytes among the 2 ranks that hold the same ones, 1/8 of them each
    assert moved["all-gather parameters"] == pytest.approx(100 * (0.1 + 0.9 * kept))
    assert moved["reduce-scatter gradients"] == pytest.approx(50 * (0.1 + 0.9 * kept))
    assert moved[EXPERT_PARALLEL] == pytest.approx(4 * m.num_layers * 7 / 8 * tokens_k_h * 2)


# ---------------------------------------------------------------- loading and the plan of a model
@pytest.mark.parametrize("kind", FAMILIES)
def test_fused_experts_are_read_from_per_expert_checkpoints(moe, kind):
    """Sharded loading reads a fused expert parameter's rows (a range of experts) from the checkpoint's per-expert
    matrices (Mixtral's renamed ones too) as from_pretrained converts them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models import Checkpoint, checkpoint_keys

    loaded = dict(AutoModelForCausalLM.from_pretrained(str(moe[kind])).named_parameters())
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(moe[kind])))
    ckpt = Checkpoint(moe[kind])
    keys = checkpoint_keys(net, ckpt)
    fused = [n for n, _ in net.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4 and not any(name in ckpt.entries for name in fused)  # stored per expert
    params = dict(net.named_parameters())
    for name in fused:
        assert torch.equal(ckpt.read(keys[id(params[name])], 1, 3), loaded[name][1:3].detach()), name


def test_the_plan_lists_each_expert_parameter_before_its_module():
    """Sharding a parameter sets its module's local expert count, which the dispatch reads when it is installed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model("qwen3_moe", hidden_size=64, num_hidden_layers=2, num_experts=4, vocab_size=96)
        )
    plan = list(ep.expert_plan(model).items())
    modules = [i for i, (_, style) in enumerate(plan) if style == ep.DISPATCH]
    assert [plan[i][0] for i in modules] == [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
    for i in modules:
        assert [style for _, style in plan[i - 2 : i]] == ["grouped_gemm"] * 2  # gate_up_proj and down_proj first


def test_lora_on_the_routed_experts_is_refused_on_the_rank():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3_moe", hidden_size=64, num_hidden_layers=1, num_experts=4, vocab_size=96)
    )
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", lora_dropout=0.0))

    class Grid(dict):  # what parallelize reads of a mesh before it splits anything
        def size(self):
            return 2

    grid = Grid(ep=Grid(), etp=Grid())
    with pytest.raises(FtError, match=r"distributed\.expert_parallel: 2 cannot split LoRA adapters"):
        ep.parallelize(wrapped.get_base_model(), grid)


# ---------------------------------------------------------------- on gloo ranks
def _torchrun(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
        + [f"--master-port={free_port()}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=timeout,
    )


def _ep_folder(tmp_path, config_path, *sets: str) -> Path:
    """The job planned for FSDP2 on 2 CPU processes with distributed.expert_parallel: 2, and its run folder written
    (plan.json) as ft train writes it before it starts the ranks."""
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan as make_plan
    from finetune.workflow import model_facts, write_run_folder

    run = tmp_path / "ep"
    config = load(str(config_path), ["distributed.expert_parallel=2", f"output.dir={run}", *sets])
    p = make_plan(config, parse("cpu:2"), model_facts(config.model))
    assert (p.backend, p.world_size, p.expert_parallel) == ("fsdp", 2, 2)
    run.mkdir(exist_ok=True)
    write_run_folder(run, config, p, prepare(config), ["(test)"])
    return run


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, moe):
    """One torchrun of 2 ranks (tests/scripts/ep_probe.py) for every 2-rank job of this file, one after another: each
    family's split against its whole model; the Qwen3-MoE full fine-tuning job from its run folder as ft train starts
    it (6 steps, a checkpoint at step 3), then a copy of that folder resumed from its step-3 checkpoint; the LoRA job
    on the attention. The same full and LoRA jobs in one process (this one)."""
    root = tmp_path_factory.mktemp("ep")
    out = {"probe": root / "probe"}
    out["probe"].mkdir()
    runs = []
    for name, sets in (("full", []), ("lora", [ATTENTION_LORA, "train.lr=0.02"])):
        folder = root / name
        folder.mkdir()
        job = _job(folder, moe["qwen3_moe"], moe["data"], "one")
        train_here(job, *[a for s in sets for a in ("--set", s)])
        out[name] = {"one": folder / "one", "ep": _ep_folder(folder, job, *sets)}
        runs.append(f"run={out[name]['ep']}")
    out["full"]["resumed"] = root / "full" / "ep-resumed"  # the step-3 checkpoint's copy, resumed
    step3 = out["full"]["ep"] / "checkpoints" / "step-00000003"
    runs.insert(1, f"run={out['full']['resumed']}@resume={step3}")
    r = _torchrun([str(REPO / "tests" / "scripts" / "ep_probe.py"), str(out["probe"]), *FAMILIES, *runs])
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.mark.slow
def test_each_family_split_over_two_ranks_computes_what_one_process_does(ep_runs):
    """The mean of the ranks' losses and every gradient (made whole) equal the whole model's; each rank holds 2 of the
    4 experts of each layer."""
    for rank in (0, 1):
        report = json.loads((ep_runs["probe"] / f"probe-rank{rank}.json").read_text())
        assert sorted(report) == sorted(FAMILIES)
        for kind, case in report.items():
            assert case["loss"][1] == pytest.approx(case["loss"][0], rel=1e-6), kind
            assert max(case["grad_errors"].values()) < 1e-5, kind
            assert case["local_experts"] and all(shape[0] == 2 for shape in case["local_experts"].values()), kind


def _logits(folder, lora_base=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(lora_base or folder))
    if lora_base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(folder))
    with torch.no_grad():
        return model.eval()(input_ids=torch.arange(3, 43).view(2, 20)).logits


@pytest.mark.slow
def test_full_fine_tuning_with_split_experts_matches_one_process_and_resumes(tmp_path, ep_runs):
    """Qwen3-MoE, experts split over 2 ranks: per-step losses and gradient norms equal one process's (2 micro-batches
    per rank and step); each rank's DCP checkpoint holds its own experts; final/ reloads in one process with one
    process's logits, the step-3 checkpoint consolidates to one process's, and a run resumed from it continues with
    the uninterrupted run's losses."""
    one_dir, run = ep_runs["full"]["one"], ep_runs["full"]["ep"]
    one, two = metric_rows(one_dir), metric_rows(run)
    a, b = losses(one_dir), losses(run)
    assert len(a) == len(b) == 6 and a[-1] < a[0]
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in two if "grad_norm" in r] == pytest.approx(
        [r["grad_norm"] for r in one if "grad_norm" in r], rel=1e-4
    )
    assert torch.allclose(_logits(run / "final"), _logits(one_dir / "final"), atol=1e-5)
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(run / "checkpoints" / "step-00000003" / "dcp")).read_metadata()
    experts = next(v for k, v in saved.state_dict_metadata.items() if k.endswith("layers.0.mlp.experts.gate_up_proj"))
    assert sorted(c.offsets[0] for c in experts.chunks) == [0, 2]  # rank 0 experts 0-1, rank 1 experts 2-3
    from finetune.consolidate import consolidate

    mine = consolidate(run, step=3, out=tmp_path / "c-ep")
    theirs = consolidate(one_dir, step=3, out=tmp_path / "c-one")
    assert torch.allclose(_logits(mine), _logits(theirs), atol=1e-5)
    # steps 4-6 again, from the checkpoint (in a copy of the run folder taken after the run)
    assert losses(ep_runs["full"]["resumed"]) == pytest.approx(b, rel=1e-5)


@pytest.mark.slow
def test_lora_on_the_attention_with_split_frozen_experts_matches_one_process(ep_runs, moe):
    """LoRA on the attention projections, the frozen experts split over 2 ranks: losses equal one process's and the
    saved adapter reloads on the base in one process with one process's logits."""
    one_dir, run = ep_runs["lora"]["one"], ep_runs["lora"]["ep"]
    a, b = losses(one_dir), losses(run)
    assert len(a) == len(b) == 6 and a[-1] < a[0]
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    base = moe["qwen3_moe"]
    assert torch.allclose(_logits(run / "final", lora_base=base), _logits(one_dir / "final", lora_base=base), atol=1e-5)


# ---------------------------------------------------------------- two GPUs (NCCL)
def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_gpus_with_split_experts_match_one_gpu(tmp_path, moe, precision):
    """ft train with distributed.expert_parallel: 2 on two GPUs (NCCL all-to-all of CUDA hidden states) against one
    GPU with twice the accumulation: fp32 equal up to the order of sums, bf16 within its rounding (and learning)."""
    from tests.helpers import GPU_TIMEOUT, ft_train, visible_gpus

    job = _job(tmp_path, moe["qwen3_moe"], moe["data"], "one")
    sets = [f"train.precision={precision}"]
    for gpus, extra in ((1, []), (2, ["distributed.expert_parallel=2", f"output.dir={tmp_path / 'two'}"])):
        r = ft_train(
            str(job), *[a for s in sets + extra for a in ("--set", s)], env=visible_gpus(gpus), timeout=GPU_TIMEOUT
        )
        assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["expert_parallel"] == 2
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 6 and b[-1] < b[0]
    assert b == pytest.approx(a, **(dict(rel=1e-3, abs=1e-4) if precision == "fp32" else dict(rel=2e-2, abs=2e-3)))
