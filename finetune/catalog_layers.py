"""The parameters of one decoder layer, built from a model's facts (finetune.catalog.ModelFacts).

A decoder layer is an attention part (grouped-query or multi-head latent attention, or a linear-attention block:
gated DeltaNet), an MLP part (dense, or a mixture of experts with optional shared experts), and its norms. Layers of
one model differ by their attention kind (`ModelFacts.layer_types`) and by whether their MLP is sparse
(`ModelFacts.dense_layers`); `layer_kinds` groups the layers that have the same parameters, so that every count
is a sum over a handful of shapes, not over every layer.

transformers 5 stores MoE experts as fused 3-D parameters (not nn.Linear), and most routers as plain parameters:
they are counted apart from the linears, which are what LoRA's "all-linear" and bitsandbytes see.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

# finetune.catalog_facts.ModelFacts, which builds its layers from this module (not imported here: no import circle)
ModelFacts = Any

FULL, SLIDING, CHUNKED, LINEAR_ATTENTION = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "linear_attention",
)
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED, LINEAR_ATTENTION)
WINDOWED = (SLIDING, CHUNKED)  # layers whose keys and values span at most `sliding_window` tokens


@dataclass(frozen=True)
class Linear:
    """One kind of nn.Linear module inside a decoder layer, named as peft sees it."""

    name: str
    in_features: int
    out_features: int
    count: int = 1
    bias: bool = False

    @property
    def params(self) -> int:
        """Weights and biases of all `count` modules of this kind."""
        per_module = self.in_features * self.out_features + (self.out_features if self.bias else 0)
        return self.count * per_module


@dataclass(frozen=True)
class LayerShape:
    """The parameters of one decoder layer of a given kind."""

    attention: str  # one of ATTENTION_KINDS
    moe: bool  # the MLP is a mixture of experts
    linears: tuple[Linear, ...]
    expert_params: int  # fused expert weights (and their biases)
    other_params: int  # norms, routers that are plain parameters, attention sinks, convolutions, decay terms

    @property
    def params(self) -> int:
        return sum(lin.params for lin in self.linears) + self.expert_params + self.other_params


def layer_kinds(f: ModelFacts) -> tuple[tuple[int, LayerShape], ...]:
    """(number of layers, shape) for each distinct layer kind, layer 0's kind first."""
    types = f.layer_types or (FULL,) * f.num_layers
    dense = set(f.dense_layers)
    kinds = Counter((types[i], f.num_experts > 0 and i not in dense) for i in range(f.num_layers))
    return tuple((n, layer_shape(f, attention, moe)) for (attention, moe), n in kinds.items())


def layer_shape(f: ModelFacts, attention: str, moe: bool) -> LayerShape:
    attn_linears, attn_other = attention_part(f, attention)
    mlp_linears, experts, mlp_other = mlp_part(f, moe)
    norms = f.norms_per_layer * norm_params(f)
    return LayerShape(attention, moe, attn_linears + mlp_linears, experts, attn_other + mlp_other + norms)


def norm_params(f: ModelFacts) -> int:
    """One hidden-size norm: RMSNorm has a weight, LayerNorm a weight and a bias."""
    return f.hidden_size * (2 if f.norm == "layer" else 1)


def attention_dims(f: ModelFacts, attention: str) -> tuple[int, int]:
    """(head_dim, key/value heads) of one attention layer: full-attention layers may differ (Gemma 4)."""
    if attention == FULL and f.global_head_dim:
        return f.global_head_dim, f.global_kv_heads or f.num_kv_heads
    return f.head_dim, f.num_kv_heads


def attention_part(f: ModelFacts, attention: str) -> tuple[tuple[Linear, ...], int]:
    """The attention block's linears and its other parameters."""
    if attention == LINEAR_ATTENTION:
        return _gated_delta_net(f)
    if f.kv_lora_rank:
        return _latent_attention(f)
    return _grouped_query_attention(f, attention)


def _grouped_query_attention(f: ModelFacts, attention: str) -> tuple[tuple[Linear, ...], int]:
    h, bias = f.hidden_size, f.attention_bias
    head_dim, kv_heads = attention_dims(f, attention)
    q, kv = f.num_attention_heads * head_dim, kv_heads * head_dim
    shares_kv = attention == FULL and f.global_k_is_v  # the keys' projection also gives the values
    if f.fused_qkv:
        qkv: tuple[Linear, ...] = (Linear("qkv_proj", h, q + 2 * kv, bias=bias),)
    else:
        qkv = (Linear("q_proj", h, q * (2 if f.query_gate else 1), bias=bias), Linear("k_proj", h, kv, bias=bias))
        qkv += () if shares_kv else (Linear("v_proj", h, kv, bias=bias),)
    out = Linear("dense" if f.model_type == "phi" else "o_proj", q, h, bias=f.o_bias)
    other = (2 * head_dim if f.qk_norm else 0) + (f.num_attention_heads if f.attention_sinks else 0)
    return qkv + (out,), other


def _latent_attention(f: ModelFacts) -> tuple[tuple[Linear, ...], int]:
    """DeepSeek's multi-head latent attention: keys and values through a compressed latent of kv_lora_rank."""
    h, heads, bias = f.hidden_size, f.num_attention_heads, f.attention_bias
    nope, rope, v = f.head_dim - f.qk_rope_head_dim, f.qk_rope_head_dim, f.v_head_dim
    if f.q_lora_rank:
        query = (Linear("q_a_proj", h, f.q_lora_rank, bias=bias), Linear("q_b_proj", f.q_lora_rank, heads * f.head_dim))
    else:
        query = (Linear("q_proj", h, heads * f.head_dim),)
    kv = (
        Linear("kv_a_proj_with_mqa", h, f.kv_lora_rank + rope, bias=bias),
        Linear("kv_b_proj", f.kv_lora_rank, heads * (nope + v)),
    )
    out = (Linear("o_proj", heads * v, h, bias=f.o_bias),)
    return query + kv + out, f.q_lora_rank + f.kv_lora_rank  # the two latents' norms


def linear_attention_dims(f: ModelFacts) -> tuple[int, int]:
    """(key width, value width) of a gated DeltaNet block."""
    return f.linear_key_heads * f.linear_key_head_dim, f.linear_value_heads * f.linear_value_head_dim


def _gated_delta_net(f: ModelFacts) -> tuple[tuple[Linear, ...], int]:
    """Qwen3-Next's and Qwen3.5's linear attention: projections, a causal convolution, per-head decay terms."""
    h, heads = f.hidden_size, f.linear_value_heads
    key, value = linear_attention_dims(f)
    if f.linear_fused_proj:
        ins = (Linear("in_proj_qkvz", h, 2 * key + 2 * value), Linear("in_proj_ba", h, 2 * heads))
    else:
        ins = (
            Linear("in_proj_qkv", h, 2 * key + value),
            Linear("in_proj_z", h, value),
            Linear("in_proj_b", h, heads),
            Linear("in_proj_a", h, heads),
        )
    conv = (2 * key + value) * f.linear_conv_kernel
    return ins + (Linear("out_proj", value, h),), conv + 2 * heads + f.linear_value_head_dim


def mlp_part(f: ModelFacts, moe: bool) -> tuple[tuple[Linear, ...], int, int]:
    """The MLP's linears, its fused expert parameters and its other parameters (routers, MoE norms)."""
    dense = dense_mlp(f, f.intermediate_size)
    if not moe:
        return dense, 0, 0
    h, experts, inter = f.hidden_size, f.num_experts, f.moe_intermediate_size
    expert_params = experts * 3 * h * inter + (experts * (2 * inter + h) if f.expert_bias else 0)
    linears = dense if f.moe_dense_mlp else ()
    router = experts * h + (experts if f.router_bias else 0)
    if f.router_linear:
        linears += (Linear(f.router_linear, h, experts, bias=f.router_bias),)
        router = 0
    if f.shared_expert_size:
        linears += dense_mlp(f, f.shared_expert_size)
    if f.shared_expert_gate:
        linears += (Linear("shared_expert_gate", h, 1),)
    extra = f.moe_norms * h + (experts if f.expert_scale else 0)
    return linears, expert_params, router + extra


def dense_mlp(f: ModelFacts, inter: int) -> tuple[Linear, ...]:
    h, bias = f.hidden_size, f.mlp_bias
    if f.mlp == "plain":
        return (Linear("fc1", h, inter, bias=bias), Linear("fc2", inter, h, bias=bias))
    if f.fused_gate_up:
        gate_up: tuple[Linear, ...] = (Linear("gate_up_proj", h, 2 * inter, bias=bias),)
    else:
        gate_up = (Linear("gate_proj", h, inter, bias=bias), Linear("up_proj", h, inter, bias=bias))
    return gate_up + (Linear("down_proj", inter, h, bias=bias),)


def merged_linears(kinds: tuple[tuple[int, LayerShape], ...]) -> tuple[Linear, ...]:
    """Every decoder linear of the model, same-shaped modules merged: `count` is their number in all layers."""
    counts: Counter = Counter()
    for layers, shape in kinds:
        for lin in shape.linears:
            counts[(lin.name, lin.in_features, lin.out_features, lin.bias)] += layers * lin.count
    return tuple(Linear(name, i, o, count=n, bias=b) for (name, i, o, b), n in counts.items())


def cache_elements(f: ModelFacts, attention: str, tokens: float) -> float:
    """What one layer keeps per sequence for generation after `tokens` tokens, in elements: keys and values (within
    the window for sliding layers), MLA's compressed latent and rotary key, or a linear-attention block's fixed state
    (its recurrent state and the convolution's last inputs)."""
    if attention == LINEAR_ATTENTION:
        key, value = linear_attention_dims(f)
        state = f.linear_value_heads * f.linear_key_head_dim * f.linear_value_head_dim
        return state + (2 * key + value) * (f.linear_conv_kernel - 1)
    if attention in WINDOWED and f.sliding_window:
        tokens = min(tokens, f.sliding_window)
    if f.kv_lora_rank:
        return (f.kv_lora_rank + f.qk_rope_head_dim) * tokens
    head_dim, kv_heads = attention_dims(f, attention)
    return 2 * kv_heads * head_dim * tokens
