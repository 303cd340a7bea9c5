"""The memory estimator: arithmetic checked by hand, and activations checked against what torch saves."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.catalog import from_hf_config, lookup
from finetune.plan.memory import Setup, activation_bytes, estimate, logits_bytes, trainable_params, weight_bytes

LLAMA8B = lookup("meta-llama/Llama-3.1-8B")


def setup(**kw) -> Setup:
    base = dict(
        adapter="lora",
        quantization="none",
        precision="bf16",
        optimizer="adamw_torch",
        micro_batch_size=1,
        seq_len=2048,
        gradient_checkpointing=False,
    )
    return Setup(**{**base, **kw})


def test_lora_trainable_params_by_hand():
    # per layer, r * (in + out): q 16*(4096+4096), k and v 16*(4096+1024), o like q, gate/up/down 16*(4096+14336)
    per_layer = 16 * (8192 + 5120 + 5120 + 8192 + 3 * 18432)
    assert trainable_params(LLAMA8B, setup()) == 32 * per_layer == 41_943_040
    only_qv = 32 * 16 * (8192 + 5120)
    assert trainable_params(LLAMA8B, setup(lora_targets=("q_proj", "v_proj"))) == only_qv
    dora = trainable_params(LLAMA8B, setup(dora=True)) - 41_943_040
    assert dora == 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # one magnitude per output feature
    assert trainable_params(LLAMA8B, setup(modules_to_save=("lm_head",))) == 41_943_040 + 128256 * 4096


def test_weight_bytes_by_dtype_and_quantization():
    n, lin = LLAMA8B.num_params, LLAMA8B.linear_params
    assert weight_bytes(LLAMA8B, setup(), 2) == 2 * n
    assert weight_bytes(LLAMA8B, setup(adapter="full"), 2) == 4 * n  # fp32 master weights
    nf4 = weight_bytes(LLAMA8B, setup(quantization="nf4", double_quant=False), 2)
    assert nf4 == pytest.approx(lin * (0.5 + 4 / 64) + (n - lin) * 2)
    dq = weight_bytes(LLAMA8B, setup(quantization="nf4"), 2)
    assert (nf4 - dq) / lin * 8 == pytest.approx(0.373, abs=0.01)  # double quantization saves ~0.37 bits/param
    int8 = weight_bytes(LLAMA8B, setup(quantization="int8"), 2)
    assert lin + (n - lin) * 2 < int8 < lin * 1.001 + (n - lin) * 2


def test_full_fine_tune_state_is_16_bytes_per_param_plus_compute_copy():
    e = estimate(LLAMA8B, setup(adapter="full"))
    n = LLAMA8B.num_params
    assert (e.device["weights"], e.device["gradients"], e.device["optimizer"], e.device["compute copy"]) == (
        4 * n,
        4 * n,
        8 * n,
        2 * n,
    )
    assert estimate(LLAMA8B, setup(adapter="full", optimizer="adamw_8bit")).device["optimizer"] == 2 * n


@pytest.mark.parametrize(
    "sharding, divided",
    [
        ("shard_grad_op", {"optimizer", "gradients", "weights"}),
        ("full_shard", {"optimizer", "gradients", "weights", "compute copy"}),
    ],
)
def test_sharding_divides_the_right_state(sharding, divided):
    whole = estimate(LLAMA8B, setup(adapter="full")).device
    part = estimate(LLAMA8B, setup(adapter="full", sharding=sharding, shard_size=8)).device
    for k in ("optimizer", "gradients", "weights"):
        assert part[k] == pytest.approx(whole[k] / 8 if k in divided else whole[k])
    if sharding == "full_shard":
        # in bf16: a decoder layer in flight beside the next one (the embeddings and the head stay sharded, walked
        # half a layer at a time: distributed/vocab.py), and the root unit (the final norm) all step
        m = LLAMA8B
        root = m.num_params - m.decoder_params - m.embedding_params - m.lm_head_params
        assert part["gathered layers"] == 2 * 2 * m.layer_params + 2 * root
        # a loss that runs the head chunk by chunk keeps it in the root unit, gathered all step (distributed/fsdp.py)
        chunked = estimate(m, setup(adapter="full", sharding=sharding, shard_size=8, loss="chunked")).device
        assert chunked["gathered layers"] == 2 * 2 * m.layer_params + 2 * (root + m.lm_head_params)
        # with the parameters offloaded the tables are FSDP2 units, each gathered whole while it runs
        offloaded = estimate(m, setup(adapter="full", sharding=sharding, shard_size=8, offload="all")).device
        largest = max(m.layer_params, m.embedding_params, m.lm_head_params)
        assert offloaded["gathered layers"] >= 2 * (m.layer_params + largest) + 2 * root


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_deepspeed_keeps_half_precision_weights_and_shards_the_fp32_master(stage):
    """DeepSpeed's bf16 mode: bf16 parameters (partitioned only by ZeRO-3), fp32 master weights, moments and gradient
    partition sharded from ZeRO-1 on; ZeRO-1 keeps the whole bf16 gradient, ZeRO-2/3 reduce it in buckets."""
    n, s = LLAMA8B.num_params, 8
    d = estimate(LLAMA8B, setup(adapter="full", sharding=stage, shard_size=s)).device
    assert d["weights"] == pytest.approx(2 * n / (s if stage == "zero3" else 1))
    assert d["master weights"] == pytest.approx(4 * n / s)
    assert d["optimizer"] == pytest.approx((8 + 4) * n / s)
    assert "compute copy" not in d
    if stage == "zero1":
        assert d["gradients"] == pytest.approx(2 * n)
    else:
        assert d["gradients"] < 2 * n / s
    # the state ZeRO-2 keeps per GPU for a 7-8B model on 16 GPUs: ~3 bytes per parameter, not 7 (as unsharded fp32
    # masters plus a bf16 copy would be)
    z2 = estimate(LLAMA8B, setup(adapter="full", sharding="zero2", shard_size=16)).device
    state = sum(z2[k] for k in ("weights", "master weights", "gradients", "optimizer"))
    assert 2.9 * n < state < 3.2 * n + 2**30  # 2 (bf16 weights) + (4 master + 8 moments + 4 gradient) / 16


def test_offload_moves_bytes_to_host():
    # ZeRO-3 constructs the model partitioned
    zero3 = dict(adapter="full", sharding="zero3", shard_size=8, loading="partitioned")
    on_device = estimate(LLAMA8B, setup(**zero3))
    opt = estimate(LLAMA8B, setup(**zero3, offload="optimizer"), processes_per_node=8)
    assert "optimizer" not in opt.device and opt.host["offloaded optimizer"] == pytest.approx(
        8 * on_device.device["optimizer"], rel=1e-6
    )
    everything = estimate(LLAMA8B, setup(**zero3, offload="all"), processes_per_node=8)
    assert everything.device_bytes < opt.device_bytes < on_device.device_bytes
    assert everything.host_bytes > opt.host_bytes


def test_checkpointing_micro_batch_and_dpo_scale_activations():
    plain = activation_bytes(LLAMA8B, setup(), 2)
    assert activation_bytes(LLAMA8B, setup(micro_batch_size=4), 2) == pytest.approx(4 * plain, rel=0.01)
    assert activation_bytes(LLAMA8B, setup(gradient_checkpointing=True), 2) < plain / 8
    assert activation_bytes(LLAMA8B, setup(sequences_per_row=2), 2) == pytest.approx(2 * plain, rel=0.01)
    assert activation_bytes(LLAMA8B, setup(attention="eager"), 2) > plain
    assert logits_bytes(LLAMA8B, setup(), 2) == 2048 * 128256 * (2 + 8)


def test_grpo_peak_is_the_larger_phase():
    train_only = estimate(LLAMA8B, setup())
    long_rollouts = estimate(LLAMA8B, setup(generation_tokens=4096, generation_batch=256))
    assert long_rollouts.device["generation (KV cache)"] > 0 and "activations" not in long_rollouts.device
    kv = 2 * 32 * 1024 * 2 * 4096 * 256
    assert long_rollouts.device["generation (KV cache)"] == pytest.approx(kv + 256 * 128256 * 4)
    assert "generation (KV cache)" not in estimate(LLAMA8B, setup(generation_tokens=64, generation_batch=1)).device
    assert train_only.device_bytes < long_rollouts.device_bytes


# ---------------------------------------------------------------- against torch
def _tiny():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return cfg, LlamaForCausalLM(cfg)


def _saved_for_backward(model, ids) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves during one forward with loss."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.numel():
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(storages.values())


@pytest.mark.parametrize("adapter", ["full", "lora"])
@pytest.mark.parametrize("mb, seq", [(2, 128), (4, 256)])
def test_activation_estimate_matches_what_torch_saves(adapter, mb, seq):
    import torch

    cfg, model = _tiny()
    facts = from_hf_config(cfg.to_dict(), "tiny")
    if adapter == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules="all-linear"))
    s = Setup(
        adapter=adapter,
        quantization="none",
        precision="fp32",
        optimizer="adamw_torch",
        micro_batch_size=mb,
        seq_len=seq,
        gradient_checkpointing=False,
        lora_r=8,
        lora_dropout=0.1,
        accelerator=False,
    )
    measured = _saved_for_backward(model, torch.randint(0, 512, (mb, seq)))
    estimated = activation_bytes(facts, s, 4) + logits_bytes(facts, s, 4)
    print(f"{adapter} mb={mb} seq={seq}: estimated/measured = {estimated / measured:.3f}")
    assert 0.9 <= estimated / measured <= 1.2


def test_checkpointed_estimate_bounds_what_torch_saves():
    import torch

    cfg, model = _tiny()
    facts = from_hf_config(cfg.to_dict(), "tiny")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    s = Setup(
        adapter="full",
        quantization="none",
        precision="fp32",
        optimizer="adamw_torch",
        micro_batch_size=4,
        seq_len=256,
        gradient_checkpointing=True,
        accelerator=False,
    )
    measured = _saved_for_backward(model, torch.randint(0, 512, (4, 256)))
    estimated = activation_bytes(facts, s, 4) + logits_bytes(facts, s, 4)
    without = activation_bytes(facts, dataclasses.replace(s, gradient_checkpointing=False), 4) + logits_bytes(
        facts, s, 4
    )
    assert measured <= estimated < without


# ---------------------------------------------------------------- mixtures of experts, latent and linear attention
QWEN3_MOE = lookup("Qwen/Qwen3-30B-A3B")


def test_qlora_leaves_fused_experts_in_16_bit():
    """bitsandbytes replaces nn.Linear modules only; transformers 5 stores experts as fused 3-D parameters."""
    n, lin, experts = QWEN3_MOE.num_params, QWEN3_MOE.linear_params, QWEN3_MOE.expert_params
    nf4 = weight_bytes(QWEN3_MOE, setup(adapter="qlora", quantization="nf4", double_quant=False), 2)
    assert nf4 == pytest.approx(lin * (0.5 + 4 / 64) + (n - lin) * 2)
    assert nf4 > 2 * experts  # the experts alone, at bf16: QLoRA barely shrinks this model
    notes = estimate(QWEN3_MOE, setup(adapter="qlora", quantization="nf4")).notes
    assert any("fused expert parameters stay bf16" in note for note in notes)
    assert not any("fused expert" in note for note in estimate(LLAMA8B, setup(quantization="nf4")).notes)


def test_moe_memory_holds_every_expert_compute_uses_the_active_ones():
    from finetune.plan.cost import forward_flops_per_token

    e = estimate(QWEN3_MOE, setup())
    assert e.device["weights"] == 2 * QWEN3_MOE.num_params  # all 128 experts of every layer
    dense_equivalent = 2 * (QWEN3_MOE.num_params - QWEN3_MOE.embedding_params)
    active = 2 * (QWEN3_MOE.active_params - QWEN3_MOE.embedding_params)
    flops = forward_flops_per_token(QWEN3_MOE, 2048)
    assert active < flops < active * 1.2 and flops < dense_equivalent / 5
    assert any(note.startswith("MoE: 128 experts of 768, 8 per token") for note in e.notes)


def test_moe_activations_count_each_routed_copy_and_the_router():
    """Per token and MoE layer: the k experts' MLP activations, the k dispatched copies in and out (2·k·h), the
    router's fp32 logits and probabilities."""
    s, t, a = setup(), 2048, 2
    twice = dataclasses.replace(QWEN3_MOE, experts_per_token=16)
    grown = activation_bytes(twice, s, a) - activation_bytes(QWEN3_MOE, s, a)
    per_token_layer = 4 * 768 * 8 + 2 * 8 * 2048
    assert grown == pytest.approx(a * t * 48 * per_token_layer)
    more_experts = dataclasses.replace(QWEN3_MOE, num_experts=256)
    router = activation_bytes(more_experts, s, a) - activation_bytes(QWEN3_MOE, s, a)
    assert router == pytest.approx(t * 48 * 2 * 128 * 4)  # 128 more fp32 logits and probabilities per token


def test_mla_generation_caches_the_latent():
    """transformers caches DeepSeek-V3's compressed latent and rotary key (576 values per token and layer), not the
    keys and values of its 128 heads (32,768 values): GRPO rollouts of the training model hold that."""
    from finetune.plan.memory import generation_bytes

    deepseek, s = lookup("deepseek-ai/DeepSeek-V3"), setup(generation_tokens=4096, generation_batch=64)
    assert generation_bytes(deepseek, s, 2) == 61 * (512 + 64) * 2 * 4096 * 64 + 64 * deepseek.vocab_size * 4
    assert any("generation caches 35,136 values per token" in note for note in estimate(deepseek, s).notes)


def test_hybrid_models_train_lora_on_every_layer_kind():
    """Qwen3.5's q_proj exists only in its 16 full-attention layers (queries and their output gate); the gated
    DeltaNet layers have their own projections."""
    qwen = lookup("Qwen/Qwen3.5-27B")
    only_q = trainable_params(qwen, setup(lora_targets=("q_proj",)))
    assert only_q == 16 * 16 * (5120 + 2 * 24 * 256)
    only_out = trainable_params(qwen, setup(lora_targets=("out_proj",)))
    assert only_out == 48 * 16 * (48 * 128 + 5120)


def test_fsdp_gathers_the_largest_layer_and_the_root_unit():
    deepseek = lookup("deepseek-ai/DeepSeek-V3")
    d = estimate(deepseek, setup(adapter="full", sharding="full_shard", shard_size=64)).device
    # the root unit keeps the final norm; the embeddings and the head are units of their own, smaller than a layer
    root = deepseek.num_params - deepseek.decoder_params - deepseek.embedding_params - deepseek.lm_head_params
    assert deepseek.layer_params > deepseek.decoder_params / 61  # an MoE layer outweighs the three dense ones
    assert deepseek.layer_params > max(deepseek.embedding_params, deepseek.lm_head_params)
    assert d["gathered layers"] == 2 * deepseek.layer_params * 2 + 2 * root


@pytest.mark.parametrize("sharding, offload", [("zero3", "optimizer"), ("full_shard", "all")])
def test_offloaded_entries_keep_one_order_under_any_hash_seed(sharding, offload):
    """The host's entries (plan.json, ft plan's table) come in the same order in every process: Python's string hashes
    differ between processes, so an order taken from a set would change from run to run."""
    import os
    import subprocess
    import sys

    code = (
        "from finetune.catalog import lookup\nfrom finetune.plan.memory import Setup, estimate\n"
        "s = Setup(adapter='full', quantization='none', precision='bf16', optimizer='adamw_torch', micro_batch_size=1,"
        f" seq_len=2048, gradient_checkpointing=False, sharding='{sharding}', shard_size=8, offload='{offload}')\n"
        "print(list(estimate(lookup('meta-llama/Llama-3.1-8B'), s).host))"
    )
    orders = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(6)
    }
    assert len(orders) == 1, orders
    assert "offloaded optimizer" in orders.pop()
