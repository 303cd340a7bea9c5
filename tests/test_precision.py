"""Pure bf16 training and the optimizer step in backward (memory savers, runtime side): CompensatedAdamW's math and
rounding (finetune/optim.py), bf16 weights, gradients and optimizer states where the plan says pure_bf16, and
OptimizerInBackward against the normal step, with checkpoints that resume exactly."""

from __future__ import annotations

import dataclasses
import io
import signal

import pytest
import torch

from finetune import optim
from finetune.errors import FtError
from finetune.optim import CompensatedAdamW, RoundingNoise
from tests.helpers import job_text, losses, setup_job

BF16_ULP_BELOW_1 = 2.0**-8  # the spacing of bf16 values in [0.5, 1)


# ---------------------------------------------------------------- CompensatedAdamW, unit level
def test_with_no_compensation_on_fp32_parameters_it_is_torchs_adamw(monkeypatch):
    monkeypatch.setattr(optim, "CHUNK", 7)  # the update a chunk at a time changes nothing
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 6)), torch.nn.Parameter(torch.randn(6))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(params):
        return [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]

    a = CompensatedAdamW(groups(ours), lr=1e-2)
    b = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(20):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def tiny_updates(make) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """4096 bf16 weights at 1.0, 100 AdamW steps of lr 1e-4 down a constant gradient: each step asks for a move of
    1e-4 (Adam's update of a constant gradient is lr), well below half a bf16 ulp (2^-9 ~ 2e-3 just under 1.0)."""
    w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    opt = make([w])
    for _ in range(100):
        w.grad = torch.ones_like(w)
        opt.step()
    return w.detach(), opt


def test_plain_bf16_adamw_loses_updates_below_half_an_ulp():
    for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.0),
        lambda ps: CompensatedAdamW(ps, lr=1e-4, compensation="none"),
    ):
        w, _ = tiny_updates(make)
        assert torch.equal(w, torch.ones_like(w))  # 100 updates of 1e-4 each: all rounded away


def test_kahan_compensation_keeps_every_update():
    w, opt = tiny_updates(lambda ps: CompensatedAdamW(ps, lr=1e-4, compensation="kahan"))
    carried = w.float() + opt.state[opt.param_groups[0]["params"][0]]["compensation"].float()
    # moved by 1e-2, to 2%: the bf16 moments round too (the first stalls just under 1, scaling the steps by ~0.99)
    assert torch.allclose(carried, torch.full_like(carried, 0.99), atol=2e-4)
    # the bf16 weight itself is the nearest bf16 value to 0.99
    assert (w.float() - 0.99).abs().max() <= BF16_ULP_BELOW_1 / 2


def test_stochastic_rounding_keeps_updates_in_expectation():
    w, opt = tiny_updates(lambda ps: CompensatedAdamW(ps, lr=1e-4, compensation="stochastic_rounding", seed=3))
    assert "compensation" not in opt.state[opt.param_groups[0]["params"][0]]  # no memory for it
    # each weight moved by whole ulps at random; their mean by 1e-2 (the spread of the mean is ~1e-4)
    assert abs(w.float().mean().item() - 0.99) < 1e-3
    assert len(w.unique()) > 1
    again, _ = tiny_updates(lambda ps: CompensatedAdamW(ps, lr=1e-4, compensation="stochastic_rounding", seed=3))
    assert torch.equal(w, again)  # seeded: a rerun draws the same


def test_rounding_noise_does_not_depend_on_chunks_or_shards(monkeypatch):
    monkeypatch.setattr(optim, "NOISE_BLOCK", 64)
    whole = RoundingNoise((1, 2, 3), 1000, 0, {}).draw(0, 1000, torch.device("cpu"))
    shard = RoundingNoise((1, 2, 3), 1000, 300, {})  # a rank holding elements 300..
    assert torch.equal(shard.at(100)(250, torch.device("cpu")), whole[400:650])
    assert not torch.equal(RoundingNoise((1, 2, 4), 1000, 0, {}).draw(0, 1000, torch.device("cpu")), whole)

    def run(chunk: int):
        monkeypatch.setattr(optim, "CHUNK", chunk)
        w, _ = tiny_updates(lambda ps: CompensatedAdamW(ps, lr=1e-3, compensation="stochastic_rounding"))
        return w

    assert torch.equal(run(1 << 24), run(256))


@pytest.mark.parametrize("compensation", ["stochastic_rounding", "kahan"])
def test_a_state_dict_round_trip_continues_exactly(compensation):
    def fresh():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(64, 8).to(torch.bfloat16))
        return w, CompensatedAdamW([w], lr=3e-3, weight_decay=0.01, compensation=compensation)

    def steps(w, opt, first, last):
        for i in range(first, last):
            w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            opt.step()

    straight, opt = fresh()
    steps(straight, opt, 0, 6)
    w, opt = fresh()
    steps(w, opt, 0, 3)
    buffer = io.BytesIO()
    torch.save({"w": w.detach(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # as checkpoint.load_tensors reads it
    resumed, opt = fresh()
    with torch.no_grad():
        resumed.copy_(saved["w"])
    opt.load_state_dict(saved["optimizer"])
    steps(resumed, opt, 3, 6)
    assert torch.equal(resumed, straight)


# ---------------------------------------------------------------- plans the runtime refuses
def test_plans_the_runtime_cannot_run_are_refused(tmp_path):
    from finetune.config import load
    from finetune.distributed.engine import check_savers
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.workflow import model_facts
    from tests.helpers import write_job

    config = load(write_job(tmp_path, job_text(tmp_path, "full")))
    p = plan(config, parse("cpu"), model_facts(config.model))
    check_savers(p, config.train)
    with pytest.raises(FtError, match="bf16-pure cannot run under DeepSpeed.*distributed.backend: fsdp"):
        check_savers(dataclasses.replace(p, precision="bf16", pure_bf16=True, backend="deepspeed"), config.train)
    in_backward = dataclasses.replace(p, optimizer_in_backward=True, gradient_accumulation_steps=2)
    with pytest.raises(FtError, match="optimizer_in_backward needs no gradient accumulation.*no clipping"):
        check_savers(in_backward, config.train)
    split = dataclasses.replace(p, tensor_parallel=2, backend="fsdp", world_size=2, processes_per_node=2)
    with pytest.raises(FtError, match="tensor_parallel: 2 does not run methods that sample during training"):
        check_savers(split, config.train, samples=True)  # the caller's section samples (GRPO)
    check_savers(split, config.train)  # the same plan for a method that samples nothing runs


# ---------------------------------------------------------------- the tiny job, in this process
def tiny_job(tmp_path, train: str, adapter: str = "full", steps: int = 30, batch: int = 8, **kw):
    """setup_job of the tiny one-process job (one micro-batch a step) with `train` (YAML flow entries) added to its
    train section."""
    text = job_text(tmp_path, adapter, steps=steps, batch=batch, micro=batch, **kw)
    assert "warmup_steps: 2}" in text
    return setup_job(tmp_path, text.replace("warmup_steps: 2}", f"warmup_steps: 2, {train}}}"))


def watch_gradients(job) -> set:
    """The dtypes of the gradients the engine's optimizer steps will see (filled as the job trains)."""
    seen, step = set(), job.engine.step

    def looking():
        seen.update(p.grad.dtype for p in job.model.parameters() if p.grad is not None)
        return step()

    job.engine.step = looking
    return seen


def trained_dtypes(job, gradients: set) -> dict:
    """The dtypes of the trained weights, their gradients and the optimizer states (after training)."""
    states = job.engine.optimizer.state.values()
    return {
        "grads": gradients,
        "weights": {p.dtype for p in job.model.parameters() if p.requires_grad},
        "states": {t.dtype for s in states for k, t in s.items() if k != "step"},
    }


@pytest.mark.slow
def test_pure_bf16_trains_like_mixed_precision_with_everything_trained_in_bf16(tmp_path):
    """Full fine-tuning of the tiny model for 30 steps (lr 3e-3): the mean loss of the last 5 steps with bf16 weights,
    gradients and moments (stochastic rounding) is within 0.02 of mixed precision's (fp32 master weights). Measured
    (CPU, torch 2.13): mixed 2.3094, pure bf16 2.3090 (kahan 2.3099, none 2.3135)."""
    from finetune.train import run

    means = {}
    for name, train, dtype in (
        ("mixed", "precision: bf16", torch.float32),
        ("pure", "precision: bf16-pure, compensation: stochastic_rounding", torch.bfloat16),
    ):
        sub = tmp_path / name
        sub.mkdir()
        _, p, _, job = tiny_job(sub, train)
        assert p.precision == "bf16" and p.pure_bf16 == (name == "pure")
        assert isinstance(job.engine.optimizer, CompensatedAdamW if name == "pure" else torch.optim.AdamW)
        gradients = watch_gradients(job)
        (sub / "run").mkdir()
        run(job, sub / "run")
        assert trained_dtypes(job, gradients) == {"grads": {dtype}, "weights": {dtype}, "states": {dtype}}
        means[name] = sum(losses(sub / "run")[-5:]) / 5
    assert abs(means["pure"] - means["mixed"]) < 0.02, means
    assert means["mixed"] < 3.0  # both learned (the first loss is ~6)


@pytest.mark.slow
def test_pure_bf16_keeps_lora_adapters_in_bf16(tmp_path):
    for name, train, dtype in (("mixed", "precision: bf16", torch.float32), ("pure", "precision: bf16-pure", None)):
        sub = tmp_path / name
        sub.mkdir()
        from finetune.train import train_step

        _, p, _, job = tiny_job(sub, train, adapter="lora", steps=2)
        gradients = watch_gradients(job)
        train_step(job)
        seen = trained_dtypes(job, gradients)
        # mixed: peft upcasts the adapters to fp32; pure: they stay bf16 like the base
        assert seen == {k: {dtype or torch.bfloat16} for k in ("grads", "weights", "states")}


@pytest.mark.slow
def test_the_optimizer_step_in_backward_equals_the_normal_step(tmp_path):
    from finetune.optim import OptimizerInBackward
    from finetune.train import train_step

    weights, norms = {}, {}
    for in_backward in (False, True):
        sub = tmp_path / str(in_backward)
        sub.mkdir()
        _, p, _, job = tiny_job(sub, f"max_grad_norm: 0, optimizer_in_backward: {str(in_backward).lower()}", batch=4)
        assert p.optimizer_in_backward == in_backward and p.gradient_accumulation_steps == 1
        assert isinstance(job.engine.optimizer, OptimizerInBackward) == in_backward
        left, step = [], job.engine.step

        def looking(step=step, job=job, left=left):
            left.append(sum(q.grad is not None for q in job.model.parameters()))
            return step()

        job.engine.step = looking
        norms[in_backward] = [train_step(job)["grad_norm"] for _ in range(4)]
        weights[in_backward] = {n: q.detach().clone() for n, q in job.model.named_parameters()}
        assert (left == [0] * 4) == in_backward  # in backward: every gradient was freed as soon as it was used
    assert max((weights[True][n] - weights[False][n]).abs().max().item() for n in weights[True]) <= 1e-6
    assert norms[True] == pytest.approx(norms[False], rel=1e-4)


@pytest.mark.slow
def test_the_optimizer_step_in_backward_with_pure_bf16_resumes_exactly(tmp_path):
    """Stopped after step 3 and resumed: the same weights as an uninterrupted run, with every per-parameter optimizer's
    state (bf16 moments) and the stochastic rounding's draws carried over; metrics.jsonl has a grad_norm each step."""
    from finetune import checkpoint
    from finetune.errors import Stopped
    from finetune.train import SignalStop, run, setup

    train = "max_grad_norm: 0, optimizer_in_backward: true, precision: bf16-pure, compensation: stochastic_rounding"
    config, p, prepared, job = tiny_job(tmp_path, train, steps=6, batch=4)
    assert p.pure_bf16 and p.optimizer_in_backward
    (tmp_path / "straight").mkdir()
    (tmp_path / "stopped").mkdir()
    run(job, tmp_path / "straight")
    straight = {n: t.detach().clone() for n, t in job.model.named_parameters()}

    stop = SignalStop()

    def stop_after_3(step, total, row):
        if step == 3:
            stop.signum = signal.SIGTERM

    with pytest.raises(Stopped):
        run(setup(config, p, prepared), tmp_path / "stopped", on_step=stop_after_3, stop=stop)
    resumed = setup(config, p, prepared)
    run(resumed, tmp_path / "stopped", resume_from=checkpoint.latest(tmp_path / "stopped"))
    assert all(torch.equal(straight[n], t) for n, t in resumed.model.named_parameters())
    from tests.helpers import metric_rows

    norms = [r["grad_norm"] for r in metric_rows(tmp_path / "stopped") if "loss" in r]
    assert len(norms) == 6 and all(isinstance(g, float) and g > 0 for g in norms)
    # the same checkpoint under a step after backward would restart its moments from zero: refused, with the key
    other = tiny_job(tmp_path / "other", "max_grad_norm: 0, precision: bf16-pure", steps=6, batch=4)
    assert not other[1].optimizer_in_backward
    with pytest.raises(FtError, match="optimizer_in_backward"):
        run(other[3], tmp_path / "stopped", resume_from=checkpoint.latest(tmp_path / "stopped"))


# ---------------------------------------------------------------- FSDP2: DTensor shards, DCP checkpoints
@pytest.mark.slow
def test_on_fsdp2_shards_the_update_is_the_one_process_update_and_resumes_exactly(tmp_path):
    """Two gloo ranks (this file's __main__) train a tiny bf16 Llama sharded by FSDP2 with CompensatedAdamW: the
    weights equal one process's bit for bit (the rounding noise does not depend on the shards), and a DCP checkpoint
    written at step 3 resumes to the same weights."""
    import json
    import os
    import subprocess
    import sys

    from tests.helpers import REPO, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), "-m", "tests.test_precision", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    for compensation in ("stochastic_rounding", "kahan"):
        assert result[compensation]["states"] == ["DTensor"], result  # per-parameter shards, as DCP needs
        assert result[compensation]["moved"] > 0
        assert result[compensation]["sharded_vs_one_process"] == 0.0, result
        assert result[compensation]["resumed_vs_straight"] == 0.0, result


def fsdp_worker(out) -> None:
    """A rank of the FSDP2 test above (started by torchrun)."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from finetune.distributed import engine, fsdp
    from tests.helpers import tiny_llama

    def train(model, optimizer, first, last):
        for i in range(first, last):
            ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i))  # the same on every rank
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def built(sharded: bool, compensation: str):
        model = tiny_llama("sdpa").train().to(torch.bfloat16)
        if sharded:
            # the ends as FSDP2 units: vocab.py's chunked head rounds its bf16 GEMMs apart from one process's, which
            # would hide what this test isolates, the optimizer's rounding on shards
            fsdp.wrap(model, "bf16", "full_shard", 1, 2, torch.device("cpu"), vocab_rows=False)
        params = list(model.parameters())
        return model, CompensatedAdamW(params, lr=1e-3, weight_decay=0.01, compensation=compensation, seed=5)

    def gathered(model) -> dict:
        return fsdp.full_state_dict(model, trainable_only=True)

    dist.init_process_group("gloo")
    result = {}
    start = {n: p.detach().clone() for n, p in tiny_llama("sdpa").to(torch.bfloat16).named_parameters()}
    for compensation in ("stochastic_rounding", "kahan"):
        one, optimizer = built(False, compensation)
        train(one, optimizer, 0, 6)
        straight, optimizer = built(True, compensation)
        train(straight, optimizer, 0, 6)
        states = sorted({type(t).__name__ for s in optimizer.state.values() for k, t in s.items() if k != "step"})
        stopped, optimizer = built(True, compensation)
        train(stopped, optimizer, 0, 3)
        folder = Path(out) / compensation
        folder.mkdir(exist_ok=True)
        engine.save_dcp(folder, stopped, optimizer)
        resumed, optimizer = built(True, compensation)
        engine.load_dcp(folder, resumed, optimizer)
        train(resumed, optimizer, 3, 6)
        whole, again, reference = gathered(straight), gathered(resumed), dict(one.named_parameters())
        if dist.get_rank() == 0:
            result[compensation] = {
                "states": states,
                "moved": max((whole[n].float() - start[n].float()).abs().max().item() for n in whole),
                "sharded_vs_one_process": max((whole[n] - reference[n]).abs().max().item() for n in whole),
                "resumed_vs_straight": max((whole[n] - again[n]).abs().max().item() for n in whole),
            }
    if dist.get_rank() == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    import sys

    from finetune.errors import exit_process

    # ends as ft's ranks do, without the interpreter's teardown, where gloo's threads could abort a finished rank
    exit_process(lambda: fsdp_worker(sys.argv[1]))
