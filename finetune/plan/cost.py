"""Estimated seconds per optimizer step, by cause: what the planner minimises among the setups that fit.

The figures are orders of magnitude for ranking setups on one piece of hardware, not promises:
  compute         6·N·t for full fine-tuning (forward 2·N·t, backward 4·N·t), 4·N·t with an adapter (the frozen
                  weights need no weight gradients), N the parameters a token computes with (an MoE model's active
                  ones: the experts its router picks, not all it holds; the embedding lookup is no matmul), plus
                  causal attention 2·seq·(q+v)/2 per token per full-attention layer and pass (a sliding layer: its
                  window; a linear-attention layer: its state update);
                  at 40% of the accelerator's dense half-precision peak (fp32: a quarter of it); per rank, the
                  decoder layers' share / tensor_parallel (the output head is whole), the tokens / context_parallel
                  A vision-language model's text tokens are computed by its language model only; its tower runs
                  over the micro-batch's image patches P (plan/memory.py): 2·N_v·P forward (N_v its encoder
                  layers' parameters) plus bidirectional attention 4·span·h_v per patch and layer, ×3 when the
                  tower trains (model.train_vision all), forward only when frozen
  recompute       the forward pass of each checkpointed layer again (a trained tower's too); the chunked loss
                  recomputes the output head
  quantization    4-bit / 8-bit bases dequantize every nn.Linear weight in forward and backward (fused MoE experts
                  stay 16-bit): memory-bound reads and writes of the weights at the memory bandwidth, per micro-batch
  eager scores    transformers' eager attention (the kernel the planner chooses where the class has no SDPA, or the
                  config names) writes and reads each attention layer's T×T scores and probabilities, (2a+4) bytes
                  per score, about three times (forward, backward) at the memory bandwidth, per micro-batch
  launches        a fixed cost per layer and micro-batch (kernel launches, Python): many tiny micro-batches are slow
  communication   plan/comm.py's bytes per step at its link speeds, less what hides behind the rest (plan/scaling.py;
                  plan/pricing.py adds it)
  host transfers  offloaded weights, gradients and optimizer states over PCIe, the optimizer step on the CPU, and
                  offloaded activations (a quarter of the compute hides them)
  generation      (rollouts, plan/rollout.py) each decode step reads the engine's weights (/ tensor parallel) and the
                  batch's KV cache at DECODE_EFFICIENCY of the memory bandwidth, or computes, whichever is slower;
                  the prompts are prefilled first at MFU
"""

from __future__ import annotations

from finetune.catalog import ModelFacts
from finetune.catalog_layers import LINEAR_ATTENTION, WINDOWED, attention_dims
from finetune.hardware import Hardware
from finetune.plan.memory import (
    DTYPE_BYTES,
    Setup,
    checkpointed_layers,
    kv_cache_bytes,
    stored_activation_bytes,
    tokens_per_micro_batch,
    trainable_params,
)

MFU = 0.4  # share of the peak a well-fed training step reaches
PCIE_BPS = 25e9  # host <-> device per GPU (PCIe 4/5 x16, in practice)
CPU_ADAM_PARAMS_PER_S = 3e8  # parameters one process's share of the CPU updates per second (AdamW)
LAUNCH_SECONDS_PER_LAYER = 3e-4  # per micro-batch, forward and backward
CPU_FLOPS = 2e11  # a CPU process, bf16/fp32, for ranking only
OVERLAP = 0.25  # share of a micro-batch's compute that activation copies hide behind (they share PCIe both ways)
DECODE_EFFICIENCY = 0.6  # share of the memory bandwidth a decode step reaches (weights and KV cache reads)
GENERATE_LAUNCHES_PER_LAYER = LAUNCH_SECONDS_PER_LAYER / 3  # transformers' generate: one forward's launches a token

# Dense bf16/fp16 tensor throughput (FLOP/s) and HBM/GDDR memory bandwidth (B/s) per accelerator family: the vendors'
# datasheet figures (NVIDIA H100 SXM 3.35 TB/s, H100 NVL 3.9, H200 4.8, A100 80GB SXM 2.0, A100 40GB 1.555, L40S 0.864,
# ...; AMD MI300X 5.3, MI250 3.2 per card = 1.6 per GCD). The longest name that matches wins.
ACCELERATORS: dict[str, tuple[float, float]] = {
    "B200": (2250e12, 8e12),
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "H100-94GB": (989e12, 3.9e12),
    "MI300X": (1307e12, 5.3e12),
    "MI250": (181e12, 1.6e12),
    "A100": (312e12, 2.0e12),
    "A100-40GB": (312e12, 1.555e12),
    "A100-SXM4-40GB": (312e12, 1.555e12),
    "A100-PCIE-40GB": (312e12, 1.555e12),
    "L40S": (362e12, 0.864e12),
    "A6000": (155e12, 0.77e12),
    "RTX4090": (165e12, 1.0e12),
    "RTX3090": (71e12, 0.94e12),
    "L4": (121e12, 0.3e12),
    "A10G": (70e12, 0.6e12),
    "A10": (125e12, 0.6e12),
    "V100": (125e12, 0.9e12),
    "T4": (65e12, 0.32e12),
}
BY_CAPABILITY = {(10, 0): "B200", (9, 0): "H100", (8, 0): "A100", (8, 9): "L40S", (8, 6): "A10", (7, 5): "T4"}


def accelerator_speed(hw: Hardware) -> tuple[float, float]:
    """(FLOP/s, memory B/s) of one device."""
    acc = hw.accelerator
    if acc is None:
        return CPU_FLOPS, 2e10
    key = acc.name.upper().replace(" ", "")
    for family in sorted(ACCELERATORS, key=len, reverse=True):
        if family in key:
            return ACCELERATORS[family]
    return ACCELERATORS.get(BY_CAPABILITY.get(acc.compute_capability or (0, 0), "T4"), ACCELERATORS["T4"])


def forward_flops_per_token(m: ModelFacts, seq_len: int) -> float:
    """Forward FLOPs of one token: its active parameters' matmuls and its attention (see the module docstring)."""
    # the embedding lookup is not a matmul (a tied head is); a text token never passes through a vision tower
    matmul = 2 * (m.active_params - m.embedding_params - m.vision_params)
    if not m.lm_head_params:
        matmul += 2 * m.embedding_params
    return matmul + attention_flops_per_token(m, seq_len)


def attention_flops_per_token(m: ModelFacts, seq_len: int) -> float:
    """Scores and weighted values of one token, causal (it sees seq_len/2 tokens on average), over all layers."""
    flops = 0.0
    for n, shape in m.layer_kinds:
        if shape.attention == LINEAR_ATTENTION:  # the state update and readout: about 4 * heads * dk * dv
            flops += n * 4 * m.linear_value_heads * m.linear_key_head_dim * m.linear_value_head_dim
            continue
        head_dim, _ = attention_dims(m, shape.attention)
        seen = seq_len / 2
        if shape.attention in WINDOWED and m.sliding_window:
            seen = min(seen, m.sliding_window)
        values = m.v_head_dim if m.is_mla else head_dim
        flops += n * 2 * seen * m.num_attention_heads * (head_dim + values)
    return flops


def step_seconds(
    m: ModelFacts, s: Setup, hw: Hardware, micro_batches: int, communication_seconds: float
) -> dict[str, float]:
    """Seconds per optimizer step on one rank, by cause (see the module docstring)."""
    flops, bandwidth = accelerator_speed(hw)
    if s.precision == "fp32":
        flops /= 4
    speed = flops * MFU
    t = tokens_per_micro_batch(s) / s.context_parallel  # a context-parallel rank computes its share of each sequence
    head = 2 * (m.lm_head_params or m.embedding_params)  # the output head is not split by tensor parallelism
    forward = ((forward_flops_per_token(m, s.seq_len) - head) / s.tensor_parallel + head) * t
    backward = (2 if s.adapter == "full" else 1) * forward
    recompute = forward * checkpointed_layers(m, s) / m.num_layers
    if s.loss == "chunked":
        recompute += 2 * t * m.hidden_size * m.vocab_size
    tower = vision_forward_flops(m, s)
    if s.tower_trains:  # its weights' and inputs' gradients: 2x its forward, whatever trains the language model
        forward, backward = forward + tower, backward + 2 * tower
        recompute += tower if s.gradient_checkpointing else 0
    frozen_tower = 0 if s.tower_trains else tower  # forward only: nothing before it needs a gradient
    out = {
        "compute": micro_batches * (forward + backward + frozen_tower) / speed,
        "recompute": micro_batches * recompute / speed,
        "launches": micro_batches * LAUNCH_SECONDS_PER_LAYER * m.num_layers,
        "communication": communication_seconds,
    }
    if s.attention == "eager":
        out["eager scores"] = micro_batches * eager_score_bytes(m, s) / bandwidth
    if s.quantization != "none":
        quantized = m.linear_params  # bitsandbytes quantizes nn.Linear only: fused experts are read as they are
        out["quantization"] = micro_batches * 3 * quantized * 2.5 / bandwidth  # forward, backward, recompute-ish
    out["host transfers"] = host_seconds(m, s, micro_batches, out["compute"] / max(micro_batches, 1))
    return {k: v for k, v in out.items() if v}


def vision_forward_flops(m: ModelFacts, s: Setup) -> float:
    """The vision tower's forward FLOPs on one micro-batch's images: its encoder layers' matmuls on every patch, and
    each patch's bidirectional attention over its image (or tile), scores and weighted values (see the docstring)."""
    v = m.vision_tower
    if v is None or not s.vision_patches:
        return 0.0
    patches = s.vision_patches * s.micro_batch_size * s.sequences_per_row
    attention = v.num_layers * 4 * (s.vision_span or s.vision_patches) * v.hidden_size
    return patches * (2 * v.params + attention)


def eager_score_bytes(m: ModelFacts, s: Setup) -> float:
    """Bytes eager attention moves for one micro-batch's scores on one rank: each attention layer's heads
    (/ tensor parallel) × rows × seq² scores of (2a+4) bytes, forward, backward and each checkpointed layer's
    recomputation (see the module docstring)."""
    a = DTYPE_BYTES[s.precision]
    layers = sum(n for n, shape in m.layer_kinds if shape.attention != LINEAR_ATTENTION)
    rows = s.micro_batch_size * s.sequences_per_row
    passes = 3 + checkpointed_layers(m, s) / m.num_layers
    heads = m.num_attention_heads / s.tensor_parallel
    return passes * layers * heads * rows * s.seq_len**2 * (2 * a + 4)


def host_seconds(m: ModelFacts, s: Setup, micro_batches: int, compute_per_micro_batch: float) -> float:
    """Time spent moving offloaded state and activations over PCIe, and stepping an offloaded optimizer on the CPU."""
    shard = max(1, s.shard_size)
    trained = trainable_params(m, s)
    seconds = 0.0
    if s.offload == "all":  # weights up for forward and backward of every micro-batch, gradients down once per step
        stored = 2 if s.quantization == "none" else 0.55
        seconds += micro_batches * 2 * m.num_params * stored / shard / PCIE_BPS
    if s.offload in ("all", "optimizer"):  # gradients down, updated parameters up, the optimizer on the CPU
        seconds += 2 * 2 * trained / shard / PCIE_BPS + trained / shard / CPU_ADAM_PARAMS_PER_S
    if s.activation_offload:
        a = 4 if s.precision == "fp32" else 2
        moved = 2 * stored_activation_bytes(m, s, a) / PCIE_BPS
        seconds += micro_batches * max(0.0, moved - OVERLAP * compute_per_micro_batch)
    return seconds


def generation_seconds(
    m: ModelFacts,
    hw: Hardware,
    precision: str,
    weight_bytes: float,
    prompt: int,
    completion: int,
    sequences: int,
    tensor_parallel: int = 1,
    generate: bool = False,
) -> float:
    """Seconds one engine takes to sample `sequences` completions of `completion` tokens after `prompt`-token prompts:
    each decode step reads its weights and the batch's KV cache once (memory-bound) or computes the batch's tokens
    (compute-bound), whichever is slower, over its `tensor_parallel` GPUs; the prompts are prefilled first.
    `generate`: transformers' generate on the training model, which also pays one forward's launches per token."""
    flops, bandwidth = accelerator_speed(hw)
    speed = flops * (0.25 if precision == "fp32" else 1) * MFU * tensor_parallel
    kv = kv_cache_bytes(m, DTYPE_BYTES[precision], prompt + completion / 2, sequences)  # what an average step reads
    read = (weight_bytes + kv) / tensor_parallel / (bandwidth * DECODE_EFFICIENCY)
    compute = forward_flops_per_token(m, prompt + completion // 2) * sequences / speed
    step = max(read, compute) + (GENERATE_LAUNCHES_PER_LAYER * m.num_layers if generate else 0)
    prefill = forward_flops_per_token(m, prompt) * prompt * sequences / speed
    return completion * step + prefill
