"""Peak memory per device (and host RAM per node) for one training setup, as a breakdown.

All figures are bytes. Notation: N total parameters, T trainable parameters, h hidden size, I MLP size,
q = heads*head_dim, kv = kv_heads*head_dim, L layers, V vocab, t tokens per micro-batch
(micro_batch * seq_len * sequences per row: 2 for DPO's chosen+rejected), a = bytes of the compute dtype (2 for
bf16/fp16, 4 for fp32), S = ranks one shard group spans.

weights        frozen base: N*a; nf4: 0.5 B per quantizable (linear/expert) parameter + constants
               (blocks of 64: fp32 absmax = 4/64 B; with double quantization 1/64 + 4/(64*256) B),
               the rest (embeddings, head, norms) in a; int8: 1 B + a 4-byte scale per output row.
               Full fine-tuning keeps fp32 master weights: 4*N.
compute copy   full fine-tuning in bf16/fp16: autocast keeps a half-precision copy of each weight it
               casts for the whole step: a*N (replicated unless the parameters are sharded).
adapter        LoRA: r*(in+out) per targeted linear, + out per module with DoRA, + modules_to_save;
               stored in fp32: 4*T.
gradients      4*T (fp32, like the trained weights).
optimizer      AdamW: 8*T (two fp32 moments); 8-bit AdamW: 2*T (paged variants may spill to host).
activations    saved for backward, per token and layer (elements): 4h + 3q + 3kv + MLP
               (gated: 4I; plain: 2I; MoE: 4*I_moe*k + experts) + LoRA inputs after dropout;
               times a*t*L. Eager attention adds heads*seq*(2a+4) per token per layer (scores,
               probabilities in fp32). With gradient checkpointing: a*h*t per layer (each layer's
               input) plus two layers' full activations (one recomputed, one's gradients).
logits         t*V*(a + 8): the logits, their fp32 upcast and the fp32 gradient of the loss.
reference      DPO/GRPO with a frozen copy as reference: the base weights again.
generation     GRPO rollouts: KV cache 2*L*kv*a*(prompt+completion) per sequence for the whole
               per-rank batch, plus fp32 logits of the last position. Rollout and backward do not
               overlap, so the peak counts the larger of the two phases.
overhead       GPU: 1 GiB CUDA context and library workspaces, plus 5% allocator fragmentation.
unsharded      FSDP with an adapter and gradient accumulation: gradient sync is off until the last
gradients      micro-batch, and FSDP2 keeps each trained parameter's whole gradient in fp32 until
               then: 4*T. (Full fine-tuning syncs every micro-batch instead: 4*N would not fit.)
loading        What a rank holds while its model is created, before gradients and optimizer states
               exist: with `replica` loading the whole model (weights, adapter, a reference copy) in
               its load dtype; with `meta` (FSDP2) or `partitioned` (ZeRO-3) loading its shard of
               them plus the largest tensor or layer in flight. The device peak is the larger of
               this and the training peak (the sum of the other terms); the breakdown shows it
               under its own key, not added to the others.

Sharding divides by S: ZeRO-1 the optimizer; ZeRO-2 and FSDP shard_grad_op also the gradients
(shard_grad_op keeps unsharded half-precision parameters between forward and backward); ZeRO-3 and
FSDP full/hybrid shard also the weights, plus two gathered layers (the one in use and the prefetched
one). Offloading moves optimizer states (`optimizer`) or weights, gradients and optimizer states
(`all`) into host RAM, which is checked per node with ~2.5 GiB per process for the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.catalog import ModelFacts

GiB = 1024**3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_BYTES = {
    "adamw_torch": 8,
    "adamw_torch_fused": 8,
    "paged_adamw_32bit": 8,
    "adamw_8bit": 2,
    "paged_adamw_8bit": 2,
}
CUDA_CONTEXT = 1 * GiB
FRAGMENTATION = 0.05
PROCESS_HOST_RAM = int(2.5 * GiB)
SHARD_PARAMS = {"zero3", "full_shard", "hybrid_shard"}
SHARD_GRADS = SHARD_PARAMS | {"zero2", "shard_grad_op"}
SHARD_OPTIMIZER = SHARD_GRADS | {"zero1"}
FSDP = {"full_shard", "shard_grad_op", "hybrid_shard"}
LOADING = "while loading (peak; not added)"  # the breakdown key of the load-time peak


@dataclass(frozen=True)
class Setup:
    """One candidate training setup: what the estimate depends on."""

    adapter: str  # full | lora | qlora
    quantization: str  # none | nf4 | int8
    precision: str  # bf16 | fp16 | fp32
    optimizer: str
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    sharding: str | None = None  # None | zero1 | zero2 | zero3 | full_shard | shard_grad_op | hybrid_shard
    shard_size: int = 1
    offload: str = "none"  # none | optimizer | all
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05
    dora: bool = False
    modules_to_save: tuple[str, ...] = ()
    double_quant: bool = True
    attention: str = "sdpa"
    sequences_per_row: int = 1  # sequences one row puts through the model (DPO: chosen + rejected, 2)
    reference_copy: bool = False  # a frozen full copy of the model as reference
    generation_tokens: int = 0  # methods that sample (GRPO): prompt + completion tokens per generated sequence
    generation_batch: int = 0  # sequences generated at once per rank
    accelerator: bool = True  # False on CPU: no CUDA context
    loading: str = "replica"  # replica | meta | partitioned: how a rank creates its model (plan.loading)
    accumulation: int = 1  # micro-batches per optimizer step on each rank


@dataclass(frozen=True)
class Estimate:
    """Bytes per device and per node's host RAM, by component."""

    device: dict[str, int]
    host: dict[str, int]
    total_params: int
    trainable_params: int
    notes: tuple[str, ...] = field(default=())

    @property
    def device_bytes(self) -> int:
        """The peak per device: the larger of training (the sum of the terms) and loading (its own term)."""
        return max(sum(v for k, v in self.device.items() if k != LOADING), self.device.get(LOADING, 0))

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


def estimate(m: ModelFacts, s: Setup, processes_per_node: int = 1) -> Estimate:
    """Peak bytes per device for setup `s` of model `m`, and host bytes per node."""
    a = DTYPE_BYTES[s.precision]
    trainable = trainable_params(m, s)
    weights = weight_bytes(m, s, a)
    state = {
        "weights": weights,
        "compute copy": a * m.num_params if s.adapter == "full" and a < 4 else 0,
        "adapter": 4 * trainable if s.adapter != "full" else 0,
        "gradients": 4 * trainable,
        "optimizer": OPTIMIZER_BYTES[s.optimizer] * trainable,
        "reference model": weight_bytes(m, s, a, frozen=True) if s.reference_copy else 0,
    }
    device, host = _shard_and_offload(m, s, a, state)
    train_peak = activation_bytes(m, s, a) + logits_bytes(m, s, a)
    gen_peak = generation_bytes(m, s, a)
    device["activations"] = activation_bytes(m, s, a) if train_peak >= gen_peak else 0
    device["logits and loss"] = logits_bytes(m, s, a) if train_peak >= gen_peak else 0
    device["generation (KV cache)"] = gen_peak if gen_peak > train_peak else 0
    if s.sharding in FSDP and s.adapter != "full" and s.accumulation > 1:
        device["unsharded gradients (accumulation)"] = 4 * trainable
    if s.accelerator:
        device["CUDA context, fragmentation"] = CUDA_CONTEXT + int(FRAGMENTATION * sum(device.values()))
    device[LOADING] = loading_bytes(m, s, a, state) + (CUDA_CONTEXT if s.accelerator else 0)
    host = {k: v * processes_per_node for k, v in host.items()}
    host["runtime per process"] = PROCESS_HOST_RAM * processes_per_node
    device = {k: int(v) for k, v in device.items() if v}
    return Estimate(device, {k: int(v) for k, v in host.items() if v}, m.num_params, trainable)


def _shard_and_offload(
    m: ModelFacts, s: Setup, a: int, state: dict[str, int]
) -> tuple[dict[str, float], dict[str, float]]:
    """Divide state by the shard group, then move offloaded parts to the host."""
    n = max(1, s.shard_size)
    sharded = {
        "weights": s.sharding in SHARD_PARAMS or (s.sharding == "shard_grad_op" and s.adapter == "full"),
        "compute copy": s.sharding in SHARD_PARAMS,
        "adapter": s.sharding in SHARD_PARAMS,
        "gradients": s.sharding in SHARD_GRADS,
        "optimizer": s.sharding in SHARD_OPTIMIZER,
        "reference model": s.sharding in SHARD_PARAMS,
    }
    device = {k: v / n if sharded[k] else v for k, v in state.items()}
    host: dict[str, float] = {}
    moved = {"optimizer"} if s.offload == "optimizer" else set(state) if s.offload == "all" else set()
    for k in moved:
        host[f"offloaded {k}"] = device.pop(k)
    if s.sharding in SHARD_PARAMS:
        device["gathered layers"] = 2 * m.layer_params * (a if s.quantization == "none" else 0.5)
    if s.sharding == "shard_grad_op" and s.adapter == "full":
        device["compute copy"] = a * m.num_params  # kept unsharded between forward and backward
    return device, host


def loading_bytes(m: ModelFacts, s: Setup, a: int, state: dict[str, int]) -> float:
    """What one rank holds on its device while creating the model (see the module docstring)."""
    held = state["weights"] + state["adapter"] + state["reference model"]
    if s.loading == "replica":
        return held
    if s.offload == "all":  # the shards are created in host memory
        held = 0
    largest = max(m.layer_params, m.embedding_params, m.lm_head_params) * (4 if s.adapter == "full" else a)
    return held / max(1, s.shard_size) + largest


def trainable_params(m: ModelFacts, s: Setup) -> int:
    """Parameters the optimizer updates."""
    if s.adapter == "full":
        return m.num_params
    total = 0
    for lin in targeted_linears(m, s.lora_targets):
        total += lin.count * (s.lora_r * (lin.in_features + lin.out_features) + (lin.out_features if s.dora else 0))
    total *= m.num_layers
    for name in s.modules_to_save:
        if name in ("embed_tokens", "wte"):
            total += m.embedding_params
        elif name == "lm_head":
            total += m.lm_head_params or m.embedding_params  # a tied head trains the embedding table
    return total


def targeted_linears(m: ModelFacts, targets: str | tuple[str, ...]):
    """The decoder-layer linears a LoRA adapter wraps (`all-linear` or module names)."""
    layer = m.layer_linears()
    if targets == "all-linear":
        return layer
    return tuple(lin for lin in layer if lin.name in targets)


def weight_bytes(m: ModelFacts, s: Setup, a: int, frozen: bool = False) -> float:
    """Bytes of the model's weights as stored (the trained fp32 master for full fine-tuning)."""
    if s.adapter == "full" and not frozen:
        return 4 * m.num_params
    quantizable = m.linear_params + m.expert_params
    rest = m.num_params - quantizable
    if s.quantization == "nf4":
        constants = (1 / 64 + 4 / (64 * 256)) if s.double_quant else 4 / 64
        return quantizable * (0.5 + constants) + rest * a
    if s.quantization == "int8":
        rows = sum(lin.out_features * lin.count for lin in m.layer_linears()) * m.num_layers
        return quantizable + 4 * rows + rest * a
    return m.num_params * a


def tokens_per_micro_batch(s: Setup) -> int:
    return s.micro_batch_size * s.seq_len * s.sequences_per_row


def layer_activation_elements(m: ModelFacts, s: Setup) -> float:
    """Elements saved for backward per token in one decoder layer (no checkpointing)."""
    h, q, kv = m.hidden_size, m.q_dim, m.kv_dim
    if m.num_experts:
        mlp = 4 * m.moe_intermediate_size * m.experts_per_token + m.num_experts
    else:
        mlp = 4 * m.intermediate_size if m.mlp == "gated" else 2 * m.intermediate_size
    elems = 4 * h + 3 * q + 3 * kv + mlp
    if s.adapter != "full" and s.lora_dropout > 0:
        elems += sum(lin.count * (lin.in_features + s.lora_r) for lin in targeted_linears(m, s.lora_targets))
    return elems


def activation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """Activations held for the backward pass of one micro-batch."""
    t = tokens_per_micro_batch(s)
    per_layer = a * t * layer_activation_elements(m, s)
    if s.attention == "eager":
        per_layer += t * m.num_attention_heads * s.seq_len * (2 * a + 4)
    if s.gradient_checkpointing:
        return a * t * m.hidden_size * m.num_layers + 2 * per_layer
    return per_layer * m.num_layers + a * t * m.hidden_size * 3  # + embeddings out, final norm in/out


def logits_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    return tokens_per_micro_batch(s) * m.vocab_size * (a + 8)


def generation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """GRPO rollout: KV cache of the per-rank batch plus fp32 logits of the last position."""
    if not s.generation_tokens:
        return 0
    kv_cache = 2 * m.num_layers * m.kv_dim * a * s.generation_tokens * s.generation_batch
    return kv_cache + s.generation_batch * m.vocab_size * 4
