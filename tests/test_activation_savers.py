"""Selective activation checkpointing and activation offloading (finetune/activations.py): the same loss and gradients
as the plain path, the planned number of layers recomputing, and what is saved or moved measured with autograd's own
saved-tensor hooks."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from finetune.activations import Offloader, checkpoint_only, decoder_layers, is_weight, offloading, spread
from finetune.models import finish_model

LAYERS = 4


def tiny_model(checkpoint_layers: int | None = None, lora: bool = False):
    """A 4-layer Llama with fixed weights; checkpointing as finish_model applies it for a plan with
    `checkpoint_layers` (None: no checkpointing; 0: a plan from before the field, every layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    net = LlamaForCausalLM(cfg)
    plan = SimpleNamespace(
        quantization="none", gradient_checkpointing=checkpoint_layers is not None, checkpoint_layers=checkpoint_layers
    )
    net = finish_model(net, plan)
    if lora:
        from peft import LoraConfig, get_peft_model

        net = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    return net.train()


IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def loss_and_grads(net, context=None):
    """One forward pass (inside `context`, as train_step wraps it) and backward pass: the loss and every gradient."""
    import contextlib

    with context or contextlib.nullcontext():
        loss = net(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}


def assert_same(a, b, tol=1e-6):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, atol=tol, rtol=0)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], atol=tol, rtol=0), name


def saved_bytes(net, min_bytes: int = 0) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward pass (at least `min_bytes` each)."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[tuple, int] = {}

    def pack(t):
        size = t.numel() * t.element_size()
        if t.untyped_storage().data_ptr() not in params and size >= min_bytes:
            seen[(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(input_ids=IDS, labels=IDS).loss.backward()
    return sum(seen.values())


# ---------------------------------------------------------------- selective checkpointing
def test_spread_picks_distinct_evenly_spaced_layers():
    for total in range(1, 13):
        for count in range(1, total + 1):
            chosen = sorted(spread(count, total))
            assert len(chosen) == count and 0 <= chosen[0] and chosen[-1] < total
    assert spread(2, 4) == {1, 3} and spread(1, 4) == {2} and spread(4, 4) == {0, 1, 2, 3}


def recomputing_layers(net) -> list[int]:
    """Per decoder layer: how many times its first sublayer ran in one forward and backward pass (2: recomputed).
    Counted inside the layer: transformers checkpoints a layer's forward, so hooks on the layer itself run once."""
    calls = [0] * LAYERS
    handles = [
        layer.input_layernorm.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(decoder_layers(net))
    ]
    net(input_ids=IDS, labels=IDS).loss.backward()
    for h in handles:
        h.remove()
    return calls


@pytest.mark.parametrize("k", [1, 2, 3, 0])
def test_checkpointing_k_layers_gives_the_plain_loss_and_gradients(k):
    plain = loss_and_grads(tiny_model())
    assert_same(loss_and_grads(tiny_model(checkpoint_layers=k)), plain)
    expected = k or LAYERS  # 0: a plan.json from before checkpoint_layers, with gradient_checkpointing on: all
    calls = recomputing_layers(tiny_model(checkpoint_layers=k))
    assert calls.count(2) == expected and calls.count(1) == LAYERS - expected
    assert {i for i, c in enumerate(calls) if c == 2} == spread(expected, LAYERS)
    assert recomputing_layers(tiny_model()) == [1] * LAYERS


def test_saved_activations_fall_as_more_layers_recompute():
    sizes = [saved_bytes(tiny_model(None))] + [saved_bytes(tiny_model(k)) for k in range(1, LAYERS + 1)]
    assert all(a > b for a, b in zip(sizes, sizes[1:])), sizes


def test_a_model_without_per_layer_checkpointing_keeps_every_layer_checkpointed(caplog):
    net = torch.nn.Sequential(torch.nn.Linear(2, 2))  # no GradientCheckpointingLayer: one flag for the whole model
    checkpoint_only(net, 0)
    assert not caplog.text
    checkpoint_only(net, 2)
    assert "train.checkpoint_layers" in caplog.text and "every layer recomputes, not 2" in caplog.text


# ---------------------------------------------------------------- activation offload
def test_offloading_gives_the_plain_loss_and_gradients_and_moves_the_saved_activations():
    plain = loss_and_grads(tiny_model())
    with_offload = tiny_model()
    offloader = Offloader(min_bytes=1024)
    assert_same(loss_and_grads(with_offload, offloader), plain, tol=0)
    stats = offloader.stats
    assert stats.moved_bytes == saved_bytes(tiny_model(), min_bytes=1024) > 0
    assert stats.skipped_weights > 0  # the weights the matmuls save stayed where they are
    assert stats.skipped_small > 0  # per-row statistics under 1 KiB
    assert stats.shared > 0  # q, k and v read one input: moved once


def test_offloading_is_off_unless_planned_and_skips_small_tensors_by_default():
    import contextlib

    assert isinstance(offloading(False), contextlib.nullcontext)
    net, offloader = tiny_model(), offloading(True)
    with offloader:
        net(input_ids=IDS, labels=IDS).loss.backward()
    assert offloader.stats.moved_bytes == saved_bytes(tiny_model(), min_bytes=offloader.min_bytes)


def test_offloading_with_lora_moves_no_frozen_weight():
    plain = loss_and_grads(tiny_model(lora=True))
    offloader = Offloader(min_bytes=1024)
    assert_same(loss_and_grads(tiny_model(lora=True), offloader), plain, tol=0)
    assert offloader.stats.skipped_weights > 0
    assert offloader.stats.moved_bytes == saved_bytes(tiny_model(lora=True), min_bytes=1024) > 0


def test_offloading_with_checkpointing_moves_only_the_checkpointed_layers_inputs():
    plain = loss_and_grads(tiny_model())
    offloader = Offloader(min_bytes=1024)
    assert_same(loss_and_grads(tiny_model(checkpoint_layers=2), offloader), plain)
    moved = offloader.stats.moved_bytes
    assert moved == saved_bytes(tiny_model(checkpoint_layers=2), min_bytes=1024)
    assert 0 < moved < saved_bytes(tiny_model(), min_bytes=1024)


def test_autocast_copies_of_trained_weights_are_weights():
    weight = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.nn.functional.linear(x, weight).sum().backward()
    assert any(t.dtype == torch.bfloat16 and t.shape in ((16, 16),) for t in saved)
    assert [is_weight(t) for t in saved] == [t.shape == (16, 16) for t in saved]


def test_offloading_under_autocast_gives_the_plain_loss_and_gradients():
    def step(context):
        import contextlib

        net = tiny_model()
        with torch.autocast("cpu", dtype=torch.bfloat16), context or contextlib.nullcontext():
            loss = net(input_ids=IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}

    offloader = Offloader(min_bytes=1024)
    assert_same(step(offloader), step(None), tol=0)
    assert offloader.stats.skipped_weights > 0 and offloader.stats.moved > 0


def test_train_step_with_offload_and_selective_checkpointing_matches_the_plain_step(tmp_path, monkeypatch):
    """The loop's own step (train.py) on ft-tiny, with the savers set in the Plan."""
    from finetune import train
    from finetune.config import load
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.train import setup, train_step
    from finetune.workflow import model_facts
    from tests.helpers import job_text, write_job

    config = load(write_job(tmp_path, job_text(tmp_path, "full", steps=2, batch=4, micro=2)))
    planned, prepared = plan(config, parse("cpu"), model_facts(config.model)), prepare(config)
    results, contexts = [], []
    monkeypatch.setattr(train, "offloading", lambda enabled: contexts.append(offloading(enabled)) or contexts[-1])
    for savers in ({}, {"activation_offload": True, "checkpoint_layers": 1, "gradient_checkpointing": True}):
        job = setup(config, dataclasses.replace(planned, **savers), prepared)
        metrics = train_step(job)
        moved = [c.stats.moved_bytes for c in contexts if isinstance(c, Offloader)]
        assert len(moved) == (2 if savers else 0) and all(moved), moved  # every micro-batch's forward pass
        results.append((metrics["loss"], metrics["grad_norm"], [p.detach().clone() for p in job.model.parameters()]))
        if savers:
            assert [layer.gradient_checkpointing for layer in decoder_layers(job.model)].count(True) == 1
    (loss_a, norm_a, weights_a), (loss_b, norm_b, weights_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and norm_a == pytest.approx(norm_b, abs=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(weights_a, weights_b)) < 1e-6


def test_the_planned_pinned_memory_is_what_torchs_host_allocator_rounds_each_buffer_up_to():
    """torch's caching host allocator pins the next power of two of each buffer (CachingHostAllocator.h): the planner's
    pinned figure, checked against its 25%-of-RAM cap, counts that, not the buffers' bytes."""
    from finetune.catalog import lookup
    from finetune.plan.memory import PINNED_ACTIVATIONS, Setup, estimate, pinned_bytes, stored_activation_bytes

    assert [pinned_bytes(n) for n in (0, 1, 2**20, 2**20 + 1, 3 * 2**20)] == [0, 1, 2**20, 2**21, 2**22]
    qwen = lookup("Qwen/Qwen2.5-7B")  # hidden 3584: one sequence's hidden states are 28 MiB, pinned as 32 MiB
    s = Setup("lora", "none", "bf16", "adamw_torch", 1, 4096, gradient_checkpointing=True, activation_offload=True)
    hidden = 2 * 4096 * 3584
    assert pinned_bytes(hidden) == 2**25 and stored_activation_bytes(qwen, s, 2) == (qwen.num_layers + 3) * hidden
    assert estimate(qwen, s).host[PINNED_ACTIVATIONS] == (qwen.num_layers + 3) * 2**25
    llama = lookup("meta-llama/Llama-3.1-8B")  # no checkpointing: MLP buffers of 14336 columns pin 16384
    s = dataclasses.replace(s, gradient_checkpointing=False)
    assert estimate(llama, s).host[PINNED_ACTIVATIONS] == pytest.approx(
        3 * 2 * 4096 * 4096 + (stored_activation_bytes(llama, s, 2) - 3 * 2 * 4096 * 4096) * 16384 / 14336, rel=1e-9
    )


@pytest.mark.gpu
def test_on_a_gpu_offloaded_activations_pin_the_rounded_sizes_the_planner_counts(monkeypatch):
    """On a GPU the moved tensors go to pinned blocks of torch's caching host allocator, each its size rounded up to a
    power of two: one micro-batch's forward pass holds exactly those blocks (host_memory_stats active_bytes), above
    the tensors' bytes, and the planner's pinned figure for the setup covers them (its activation model's tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.activations import nbytes
    from finetune.catalog import from_hf_config
    from finetune.plan.memory import Setup, offloaded_activation_bytes, pinned_bytes, stored_activation_bytes

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=192,
        intermediate_size=448,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    every_layer = SimpleNamespace(quantization="none", gradient_checkpointing=True, checkpoint_layers=0)
    net = finish_model(LlamaForCausalLM(cfg), every_layer).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 512, (2, 1000), device="cuda")  # a layer's input: 2 x 1000 x 192 x 2 B, pinned as 2**20
    sizes, copy_out = [], Offloader._copy_out
    monkeypatch.setattr(Offloader, "_copy_out", lambda self, t: sizes.append(nbytes(t)) or copy_out(self, t))
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    with offloading(True) as off:
        hidden = net.model(input_ids=ids, use_cache=False).last_hidden_state
    torch.cuda.synchronize()
    pinned = torch.cuda.host_memory_stats()["active_bytes.current"] - before
    hidden.float().sum().backward()
    s = Setup("full", "none", "bf16", "adamw_torch", 2, 1000, gradient_checkpointing=True, activation_offload=True)
    facts = from_hf_config(cfg.to_dict(), "tiny")
    planned, unrounded = offloaded_activation_bytes(facts, s, 2), stored_activation_bytes(facts, s, 2)
    print(
        f"pinned {pinned} B for {off.stats.moved_bytes} B in {len(sizes)} tensors; planned {planned:.0f} B "
        f"({unrounded:.0f} B unrounded): pinned / planned {pinned / planned:.3f}"
    )
    assert pinned == sum(pinned_bytes(n) for n in sizes) > off.stats.moved_bytes
    assert pinned <= 1.2 * planned
