"""What one micro-batch holds on the device beyond the resident state: the activations the forward pass saves, the
layer recomputed in the backward pass, a quantized base's dequantized weight, the output head's logits and loss
(plan/memory.py's notation; its module docstring states the terms).

The estimate adds the loss phase (the head's logits, their fp32 copies and gradients) to the layer phase (the layer
recomputed when checkpointed, its weight dequantized). That is conservative: autograd frees the loss's tensors before
the first decoder layer's backward runs, so the allocated peak is nearer the stored activations plus the larger of the
two; kept so until ft's own runs are measured on a GPU (published runs measured as max_memory_reserved fit the sum).
"""

from __future__ import annotations

import math

from finetune.catalog import ModelFacts
from finetune.catalog_layers import LINEAR_ATTENTION, LayerShape, attention_dims, linear_attention_dims
from finetune.plan.setup import Setup

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def transient_bytes(m: ModelFacts, s: Setup, a: int) -> tuple[float, float]:
    """(activations, logits and loss) at the peak of a micro-batch, per rank: the stored activations with the layer in
    its backward pass and its dequantized weight; the loss phase."""
    split = s.tensor_parallel * s.context_parallel  # tokens (context) and layer widths (tensor) per rank
    acts = activation_bytes(m, s, a) / split + dequantized_weight_bytes(m, s, a)
    return acts, logits_bytes(m, s, a) / s.context_parallel


def dequantized_weight_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """A quantized base's largest decoder linear, dequantized to the compute dtype for its matmul: bitsandbytes'
    MatMul4Bit (autograd/_functions.py) dequantizes the weight in the forward pass and again for the input's gradient,
    MatMul8bitLt for the gradient; torchao's linear_nf4 (dtypes/nf4tensor.py) in both. One at a time, beside the
    layer in flight (its own tensor-parallel slice)."""
    if s.quantization == "none" or s.adapter == "full":
        return 0
    largest = max((lin.in_features * lin.out_features for lin in m.decoder_linears), default=0)
    return a * largest / s.tensor_parallel


def targeted_linears(m: ModelFacts, targets: str | tuple[str, ...], linears: tuple | None = None):
    """The decoder linears a LoRA adapter wraps (`all-linear` or module names): of all layers (`count` in all of
    them), or of the given ones. Fused MoE experts are not nn.Linear modules: `all-linear` leaves them out."""
    layer = m.decoder_linears if linears is None else linears
    if targets == "all-linear":
        return layer
    return tuple(lin for lin in layer if lin.name in targets)


def tokens_per_micro_batch(s: Setup) -> int:
    return s.micro_batch_size * s.seq_len * s.sequences_per_row


def layer_activation_elements(m: ModelFacts, s: Setup) -> float:
    """Elements saved for backward per token in one decoder layer, averaged over the layers (no checkpointing)."""
    total = sum(n * _kind_activation_elements(m, s, shape) for n, shape in m.layer_kinds)
    return total / m.num_layers


def _kind_activation_elements(m: ModelFacts, s: Setup, shape: LayerShape) -> float:
    """One layer kind's saved elements per token: attention, MLP (or experts), LoRA inputs (see the docstring)."""
    elems = (
        4 * m.hidden_size + _attention_activation_elements(m, shape.attention) + _mlp_activation_elements(m, s, shape)
    )
    if s.adapter != "full" and s.lora_dropout > 0:
        # each adapter's dropped-out input and the rank-wide output of A. native_dropout also saves a bool mask (1 byte
        # an element), left out while the loss and layer phases are summed (module docstring): counting it there, the
        # planner refuses fsdp_qlora's Mistral-7B at 12 x 2048 on 2x4090 (tests/calibration.py), a run that fit
        wrapped = targeted_linears(m, s.lora_targets, shape.linears)
        elems += sum(lin.count * (lin.in_features + s.lora_r) for lin in wrapped)
    return elems


def _attention_activation_elements(m: ModelFacts, attention: str) -> float:
    if attention == LINEAR_ATTENTION:
        key, value = linear_attention_dims(m)
        return 3 * key + 3 * value + 2 * value  # queries and keys of the key width, values, the output gate
    head_dim, kv_heads = attention_dims(m, attention)
    q = m.num_attention_heads * head_dim
    if m.is_mla:
        return 3 * q + 3 * m.num_attention_heads * m.v_head_dim + m.q_lora_rank + m.kv_lora_rank
    return 3 * q + 3 * kv_heads * head_dim + (2 * q if m.query_gate else 0)


def _mlp_activation_elements(m: ModelFacts, s: Setup, shape: LayerShape) -> float:
    dense = 4 * m.intermediate_size if m.mlp == "gated" else 2 * m.intermediate_size
    if not shape.moe:
        return dense
    k, a = m.experts_per_token, DTYPE_BYTES[s.precision]
    experts = 4 * m.moe_intermediate_size * k + 2 * k * m.hidden_size  # the k experts' MLPs, the dispatched copies
    router = 2 * m.num_experts * 4 / a  # logits and probabilities, in fp32
    return experts + router + 4 * m.shared_expert_size + (dense if m.moe_dense_mlp else 0)


def checkpointed_layers(m: ModelFacts, s: Setup) -> int:
    """Decoder layers that recompute their activations in the backward pass."""
    if s.checkpoint_layers is not None:
        return min(s.checkpoint_layers, m.num_layers)
    return m.num_layers if s.gradient_checkpointing else 0


def layer_activation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """One decoder layer's saved activations for one micro-batch (no checkpointing)."""
    t = tokens_per_micro_batch(s)
    per_layer = a * t * layer_activation_elements(m, s)
    if s.attention == "eager":
        per_layer += t * m.num_attention_heads * s.seq_len * (2 * a + 4)
    return per_layer


def stored_activation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """What the forward pass leaves for the backward pass: each checkpointed layer's input, every other layer's
    activations, and the embedding output and final norm around them."""
    t, k = tokens_per_micro_batch(s), checkpointed_layers(m, s)
    return a * t * m.hidden_size * (k + 3) + (m.num_layers - k) * layer_activation_bytes(m, s, a)


def activation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """Activations on the device at the peak of one micro-batch's backward pass: the stored activations (or, when they
    are offloaded, the two layers' worth in flight), plus a checkpointed layer's recomputed activations and their
    gradients."""
    per_layer, k = layer_activation_bytes(m, s, a), checkpointed_layers(m, s)
    working = per_layer if k else 0  # the layer being recomputed (its gradients are transient, layer by layer)
    if s.activation_offload:  # two layers' stored tensors in flight: a checkpointed layer stores only its input
        stored = a * tokens_per_micro_batch(s) * m.hidden_size if k == m.num_layers else per_layer
        return 2 * stored + working + block_mask_bytes(m, s)
    return stored_activation_bytes(m, s, a) + working + block_mask_bytes(m, s)


FLEX_BLOCK = 128  # torch's flex_attention block (torch/nn/attention/flex_attention.py _DEFAULT_SPARSE_BLOCK_SIZE)


def block_mask_bytes(m: ModelFacts, s: Setup) -> float:
    """flex_attention's block masks for one micro-batch (transformers builds one per attention layer type, H=None):
    kv_indices, full_kv_indices, q_indices and full_q_indices, int32 (blocks x blocks) per row. 0 for other kernels."""
    if s.attention != "flex_attention":
        return 0
    kinds = {shape.attention for _, shape in m.layer_kinds if shape.attention != LINEAR_ATTENTION}
    blocks = -(-s.seq_len // FLEX_BLOCK)
    return max(1, len(kinds)) * s.micro_batch_size * s.sequences_per_row * 4 * 4 * blocks * blocks


def offloaded_activation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """Host memory for offloaded activations: one micro-batch's stored activations (stored_activation_bytes), each
    buffer as torch's pinned allocator rounds it (`pinned_bytes`): the k checkpointed layers' inputs, the embedding
    output and final norm are t*h*a each; every other layer's buffers at the most any of its widths rounds up."""
    t, k = tokens_per_micro_batch(s), checkpointed_layers(m, s)
    inputs = (k + 3) * pinned_bytes(a * t * m.hidden_size)
    return inputs + (m.num_layers - k) * layer_activation_bytes(m, s, a) * _layer_rounding(m, s, a)


def pinned_bytes(nbytes: float) -> int:
    """What torch's caching host allocator pins for a buffer of `nbytes`: the next power of two (torch 2.13
    ATen/core/CachingHostAllocator.h:300-309, PowerOf2Ceil below pinned_max_round_threshold_mb, unset by default:
    c10/core/AllocatorConfig.h:361), up to twice the buffer; freed blocks stay pinned for reuse."""
    n = math.ceil(nbytes)
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _layer_rounding(m: ModelFacts, s: Setup, a: int) -> float:
    """The most a saved tensor of a decoder layer is rounded up (pinned / its bytes): each is t tokens by a width of
    the layer's linears' inputs or outputs (hidden size, q, kv, MLP), or by the heads' scores (eager). Experts see a
    share of the tokens that routing decides: up to 2."""
    if m.is_moe:
        return 2.0
    t = tokens_per_micro_batch(s)
    widths = {m.hidden_size, *(w for lin in m.decoder_linears for w in (lin.in_features, lin.out_features))}
    if s.attention == "eager":
        widths.add(m.num_attention_heads * s.seq_len)
    return max(pinned_bytes(a * t * w) / (a * t * w) for w in widths)


def logits_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """The output head and loss: plain materialises t·V logits, their fp32 copy and its fp32 gradient (of the trained
    positions only where methods/head.py runs the head on those: `trained_share` of t, from the prepared rows); chunked
    holds one chunk of those plus the final hidden states it recomputes from; a fused kernel only the hidden states'
    fp32 gradient."""
    t, h, v = tokens_per_micro_batch(s), m.hidden_size, m.vocab_size
    if s.head == "score":  # a reward model: one score per sequence, read from the last hidden states
        return t * h * (a + 4)
    per_logit = 8 + (a if a < 4 else 0)  # fp32 logits and their gradient, plus the half-precision logits they came from
    if s.loss == "plain" and s.loss_copies != "none":
        # transformers <= 4.44 (models/llama/modeling_llama.py LlamaForCausalLM.forward): `logits.float()`, then
        # `logits[..., :-1, :].contiguous()` for CrossEntropyLoss, whose log_softmax saves its fp32 output: three fp32
        # copies in the forward pass, three in the backward (that output, its gradient, the input's), and the model
        # output's fp32 logits besides while the caller keeps them
        per_logit = 12 + (4 if s.loss_copies == "kept" else 0)
    if s.loss == "chunked":
        return min(t, s.loss_chunk_tokens or t) * v * per_logit + t * h * (a + 4)
    if s.loss == "fused":
        return t * h * (a + 8)
    return t * s.trained_share * v * per_logit


def vision_activation_bytes(m: ModelFacts, s: Setup, a: int) -> float:
    """A vision-language model's tower on one micro-batch's images (P positions: vision_patches per sequence): per
    position and layer attention 10h (4h + 3q + 3kv, the tower's heads spanning h) and its MLP (2I; 3I with a
    composite activation such as quick_gelu; gated 4I), plus
    eager attention's scores and probabilities, heads × span² × (2a+4) per image or tile. Trained (train_vision all):
    every layer's, or with checkpointing each layer's input and one layer recomputed; frozen, nothing is saved for
    backward: one layer's working set in flight. Either way its output for the projector, a*P*h; a cross-attention
    tower's (Llama 3.2 Vision) also the projected tiles in the language model's width and each cross-attention
    layer's keys and values of them, saved for the language model's backward."""
    v = m.vision_tower
    if v is None or not s.vision_patches:
        return 0
    p = s.vision_patches * s.micro_batch_size * s.sequences_per_row
    layer = a * p * (10 * v.hidden_size + v.mlp_saved * v.intermediate_size)
    if s.attention == "eager" and s.vision_span:
        layer += (p / s.vision_span) * v.num_heads * s.vision_span**2 * (2 * a + 4)
    output = a * p * v.hidden_size
    if v.cross_attention_layers:
        output += a * p * (m.hidden_size + v.cross_attention_layers * 2 * m.num_kv_heads * m.head_dim)
    if not s.tower_trains:
        return layer + output
    if s.gradient_checkpointing:
        return a * p * v.hidden_size * v.num_layers + layer + output
    return v.num_layers * layer + output
