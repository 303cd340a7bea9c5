"""train.compile: regional compilation (each decoder layer on its own) gives the eager model's loss and gradients,
the planner decides `auto` with a reason and refuses `true` where it cannot work, and a compile failure at run time is
one FtError."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch

from finetune.catalog import lookup
from finetune.compile import compile_layers, is_compiled
from finetune.config import loads
from finetune.errors import FtError, PlanError
from finetune.hardware import parse
from finetune.plan import plan
from tests.helpers import MINIMAL, tiny_llama

HAS_CXX = shutil.which("g++") is not None


def step_of(model, ids):
    """Loss and gradients of one forward/backward pass on `ids`."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def same_step(backend: str) -> None:
    """Compiled layers (the first checkpointed, the second not: both paths) match the eager model on one step."""
    eager = tiny_llama("sdpa").train()
    eager.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    eager.model.layers[1].gradient_checkpointing = False
    compiled = copy.deepcopy(eager)
    assert compile_layers(compiled, backend=backend) == 2
    assert all(is_compiled(layer) for layer in compiled.model.layers) and not is_compiled(compiled)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    loss_e, grads_e = step_of(eager, ids)
    loss_c, grads_c = step_of(compiled, ids)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys() and len(grads_e) == len(list(eager.parameters()))
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert dict(compiled.named_parameters()).keys() == dict(eager.named_parameters()).keys()  # names unchanged


@pytest.mark.slow
def test_compiled_layers_give_the_eager_loss_and_gradients():
    """aot_eager traces each layer and its backward (checkpointed or not) as inductor would, without generating code."""
    same_step("aot_eager")


def test_compiling_raises_dynamos_recompile_limit_and_never_lowers_it():
    """The layers share one code object, whose variants (first layer or not, training or evaluation, static or dynamic
    shapes) exceed torch's default of 8; past the limit dynamo would run them eagerly without a word."""
    import torch._dynamo

    from finetune.compile import RECOMPILE_LIMIT

    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        config.recompile_limit = 8
        compile_layers(tiny_llama("sdpa"), backend="aot_eager")
        assert config.recompile_limit == RECOMPILE_LIMIT > 8
        config.recompile_limit = 100
        compile_layers(tiny_llama("sdpa"), backend="aot_eager")
        assert config.recompile_limit == 100
    finally:
        config.recompile_limit = before


@pytest.mark.slow
def test_generation_runs_compiled_layers_eagerly_so_training_stays_compiled():
    """A generate() call (task evaluation, rollouts) inside engine.generation() compiles nothing: its KV cache would
    otherwise recompile each layer until torch's limit, after which training would run uncompiled too."""
    from torch._dynamo.utils import counters

    from finetune.distributed.engine import TorchEngine

    torch._dynamo.reset()
    model = tiny_llama("sdpa")
    compile_layers(model, backend="aot_eager")
    engine = TorchEngine(model, None, None, 1.0, False, torch.device("cpu"))
    engine.compiled = True
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    graphs = counters["stats"]["unique_graphs"]
    model.eval()
    with torch.no_grad(), engine.generation():
        out = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 11)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled for generation
    with torch.no_grad():  # the control: outside it, generating compiles graphs of its own
        model.generate(ids[:, :5], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert counters["stats"]["unique_graphs"] > graphs
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CXX, reason="torch's CPU compiler (inductor) needs a C++ compiler")
def test_inductor_layers_give_the_eager_loss_and_gradients():
    same_step("inductor")


@pytest.mark.own_process  # a process group in-process: not in a pytest worker shared with later tests
@pytest.mark.slow
def test_compiled_layers_under_fsdp2_give_the_eager_loss_and_gradients():
    """Layers sharded first, then compiled (as a model FSDP2 built on the meta device reaches engine.build): FSDP2's
    per-layer units keep their hooks, the layers are found after fully_shard swapped their classes, one gloo rank."""
    from finetune.distributed import fsdp
    from tests.helpers import in_a_one_rank_group

    def check():
        eager = tiny_llama("sdpa").train()
        sharded = copy.deepcopy(eager)
        fsdp.wrap(sharded, "fp32", "full_shard", 1, 1, torch.device("cpu"), split_layers=False)
        assert compile_layers(sharded, backend="aot_eager") == 2
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
        loss_e, grads_e = step_of(eager, ids)
        loss_s, grads_s = step_of(sharded, ids)
        torch.testing.assert_close(loss_s, loss_e, rtol=1e-5, atol=1e-6)
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_s[name].full_tensor(), grad, rtol=1e-4, atol=1e-6, msg=name)

    in_a_one_rank_group(check)


def test_a_compile_failure_is_one_error_naming_the_key():
    from finetune.distributed import engine

    def broken(graph, example_inputs):
        raise RuntimeError("no code generator")

    cfg = loads(MINIMAL, overrides=["train.compile=true"], environ={})
    p = dataclasses.replace(planned(["train.compile=false"], hardware="cpu"), compile=True)
    model = tiny_llama("sdpa").train()
    wrapped = engine.build(model, p, cfg.train, None, torch.device("cpu"), total_steps=4)
    assert all(is_compiled(layer) for layer in model.model.layers)  # the engine compiled them (inductor)
    compile_layers(model, backend=broken)
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(
        FtError, match=r"train\.compile: torch\.compile could not compile.*RuntimeError: no code generator"
    ) as e:
        with wrapped.accumulating(last=True):
            wrapped.model(input_ids=ids, labels=ids).loss.backward()
    assert "train.compile: false" in str(e.value)


# ---------------------------------------------------------------- the planner
def planned(overrides=(), hardware="cpu", model="Qwen/Qwen2.5-0.5B"):
    cfg = loads(MINIMAL, overrides=[f"model.name={model}", "data.seq_len=256", *overrides], environ={})
    return plan(cfg, parse(hardware), lookup(model))


def test_auto_is_off_on_cpu_without_a_cxx_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    p = planned(["train.max_steps=1000000"])
    assert p.compile is False
    assert "no C++ compiler found" in p.decision("compile").reason
    with pytest.raises(PlanError, match=r"train\.compile: true cannot run here: no C\+\+ compiler found.*false"):
        planned(["train.compile=true"])


@pytest.mark.skipif(not HAS_CXX, reason="needs a C++ compiler")
def test_auto_compiles_when_the_steps_repay_the_compile_time(monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    short, long = (planned([f"train.max_steps={n}", "data.packing=false"], model="ft-tiny") for n in (10, 1_000_000))
    assert short.compile is False and "would not repay" in short.decision("compile").reason
    assert long.compile is True and "repays its cost" in long.decision("compile").reason
    unknown = planned(["train.max_steps=null", "train.epochs=1", "data.packing=false"])
    assert unknown.compile is False and "not known when planning" in unknown.decision("compile").reason
    forced = planned(["train.compile=true", "train.max_steps=10"])
    assert forced.compile is True and forced.decision("compile").source == "config"
    assert planned(["train.compile=false"]).decision("compile").reason == "as set in the config"
    assert planned(["train.compile=true"]).to_json()["compile"] is True
    assert type(long).from_json(long.to_json()).compile is True
    packed = planned(["train.max_steps=1000000", "data.packing=true"], model="ft-tiny")
    assert packed.compile is False and "new sample lengths" in packed.decision("compile").reason


def test_auto_is_off_on_gpus_without_triton(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    p = planned(["train.max_steps=1000000"], hardware="1xH100-80GB")
    assert p.compile is False and "Triton is not installed" in p.decision("compile").reason


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["quantization.type=nf4", "adapter.type=qlora"], "bitsandbytes nf4 layers"),
        (["distributed.backend=deepspeed", "distributed.sharding=zero2"], "DeepSpeed"),
    ],
)
def test_true_with_an_unsupported_setup_is_refused(monkeypatch, overrides, why):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    with pytest.raises(PlanError, match=rf"train\.compile: true cannot run here: .*{why}.*train\.compile: false"):
        planned(["train.compile=true", *overrides], hardware="1xH100-80GB")
    auto = planned(overrides, hardware="1xH100-80GB")
    assert auto.compile is False and why in auto.decision("compile").reason
