"""ModelFacts: the architecture of one causal language model, as transformers builds it.

What a model's config.json says about its shape, plus the switches that decide which parameters transformers creates
(bias terms, norm kind, fused projections, attention kinds per layer, latent attention, experts). Every count is built
from those facts (finetune/catalog_layers.py), never from a rounded marketing size, and the tests check each catalog
entry against a model instantiated by transformers on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from finetune.catalog_layers import (
    ATTENTION_KINDS,
    LINEAR_ATTENTION,
    LayerShape,
    Linear,
    cache_elements,
    layer_kinds,
    merged_linears,
    norm_params,
)
from finetune.catalog_vision import VisionTower

MLP_KINDS = ("gated", "plain")
NORM_KINDS = ("rms", "layer")


@dataclass(frozen=True)
class ModelFacts:
    """The architecture of one causal language model, as transformers builds it.

    The first block is what every model has; the rest are switches and sizes that only some families use, each 0,
    False or empty where it does not apply (see finetune/catalog_layers.py for how they become parameters).
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # a dense MLP's hidden size (dense layers of an MoE model too)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int  # queries' and keys' head size (MLA: the no-RoPE part plus qk_rope_head_dim)
    tie_word_embeddings: bool
    max_position_embeddings: int
    mlp: str = "gated"  # "gated": gate/up/down projections; "plain": fc1/fc2
    norm: str = "rms"  # "rms": weight only; "layer": weight and bias
    norms_per_layer: int = 2  # hidden-size norms in one decoder layer (gemma2/3/4 have 4, phi 1)
    qk_norm: bool = False  # per-head RMS norm on queries and keys (qwen3, gemma3)
    attention_bias: bool = False  # bias on the q, k and v projections
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    lm_head_bias: bool = False
    fused_qkv: bool = False  # one qkv_proj instead of q_proj/k_proj/v_proj (phi3)
    fused_gate_up: bool = False  # one gate_up_proj instead of gate_proj/up_proj (phi3)
    # --- layer kinds: attention per layer (full, sliding or chunked window, linear attention) ---
    layer_types: tuple[str, ...] = ()  # one per layer; () means every layer full attention
    sliding_window: int = 0  # tokens a sliding or chunked layer attends to (and caches)
    query_gate: bool = False  # q_proj also computes a gate on the attention output (Qwen3-Next, Qwen3.5)
    attention_sinks: bool = False  # one learned sink logit per head (gpt-oss)
    global_head_dim: int = 0  # full-attention layers' own head size (Gemma 4)
    global_kv_heads: int = 0  # and their key/value heads
    global_k_is_v: bool = False  # and their keys' projection gives the values too
    # --- multi-head latent attention (DeepSeek-V3): keys and values through a compressed latent ---
    q_lora_rank: int = 0  # 0: queries projected directly
    kv_lora_rank: int = 0  # 0: not MLA
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # --- linear attention (gated DeltaNet) ---
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    linear_fused_proj: bool = False  # in_proj_qkvz/in_proj_ba (Qwen3-Next) instead of four projections (Qwen3.5)
    # --- mixture of experts ---
    num_experts: int = 0  # routed experts per MoE layer; 0 for a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # hidden size of one expert's MLP
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model with a dense MLP instead
    shared_expert_size: int = 0  # hidden size of the always-active shared expert MLP (all shared experts together)
    shared_expert_gate: bool = False  # a one-output linear gating the shared expert (Qwen)
    router_linear: str = ""  # the router's module name where it is an nn.Linear (llama4, gemma4); "": a parameter
    router_bias: bool = False
    expert_bias: bool = False  # biases on the experts' projections (gpt-oss)
    moe_dense_mlp: bool = False  # MoE layers also run the dense MLP (Gemma 4)
    moe_norms: int = 0  # further hidden-size vectors in each MoE layer (Gemma 4: three norms and a router scale)
    expert_scale: bool = False  # a learned scale per expert (Gemma 4)
    checkpoint_quantization: str = ""  # the published weights' format where quantized (gpt-oss: mxfp4)
    counts_exact: bool = True  # False where the layout was guessed (an unknown model_type)
    vision_params: int = 0  # a vision-language model's vision tower and projector (estimated from its vision_config)
    projector_params: int = 0  # the projector's part of vision_params
    image_processor: bool = False  # its processor files are known to exist (a hub model's always are)
    vision_model_type: str = ""  # a vision-language model's own model_type (llava, qwen2_vl...; model_type: its text's)
    vision_tower: VisionTower | None = None  # its tower's shape and the processor's resolution (catalog_vision.py)
    source: str = ""  # where the catalog's values come from
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = _shape_problems(self) + _layer_problems(self)
        if problems:
            raise ValueError(f"ModelFacts {self.name!r}: " + "; ".join(problems))

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @cached_property
    def layer_kinds(self) -> tuple[tuple[int, LayerShape], ...]:
        """(number of layers, shape) of each distinct kind of decoder layer, layer 0's first."""
        return layer_kinds(self)

    def layer_linears(self) -> tuple[Linear, ...]:
        """The nn.Linear modules of layer 0: what LoRA "all-linear" and bitsandbytes see in it.

        MoE experts are not listed: transformers 5 stores them as fused 3-D parameters, and most routers are plain
        parameters too (see `expert_params` and `other_params`).
        """
        return self.layer_kinds[0][1].linears

    @cached_property
    def decoder_linears(self) -> tuple[Linear, ...]:
        """Every nn.Linear of the decoder, same-shaped ones merged (`count`: their number in all layers)."""
        return merged_linears(self.layer_kinds)

    @property
    def embedding_params(self) -> int:
        """The input embedding table."""
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """The output projection; 0 when it shares the embedding's weight."""
        if self.tie_word_embeddings:
            return 0
        return self.vocab_size * self.hidden_size + (self.vocab_size if self.lm_head_bias else 0)

    @property
    def linear_params(self) -> int:
        """All decoder layers' nn.Linear weights and biases: what bitsandbytes quantizes (it leaves nn.Linear subclasses
        alone: Llama 4's router, 0.004% of its parameters, is counted here all the same)."""
        return sum(lin.params for lin in self.decoder_linears)

    @property
    def expert_params(self) -> int:
        """All layers' MoE expert weights (fused 3-D parameters in transformers 5, which stay 16-bit under QLoRA)."""
        return sum(n * shape.expert_params for n, shape in self.layer_kinds)

    @property
    def decoder_params(self) -> int:
        """All decoder layers' parameters."""
        return sum(n * shape.params for n, shape in self.layer_kinds)

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (the unit FSDP gathers)."""
        return max(shape.params for _, shape in self.layer_kinds)

    @property
    def num_params(self) -> int:
        """Total parameters, as transformers instantiates the model (tied weights counted once)."""
        text = self.embedding_params + self.lm_head_params + self.decoder_params + norm_params(self)
        return text + self.vision_params

    @property
    def other_params(self) -> int:
        """Norms, routers and everything else that is not embedding, head, linear or expert."""
        counted = self.embedding_params + self.lm_head_params + self.linear_params + self.expert_params
        return self.num_params - counted

    @property
    def moe_layers(self) -> int:
        """Decoder layers whose MLP is a mixture of experts."""
        return sum(n for n, shape in self.layer_kinds if shape.moe)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all but the experts the router does not pick for it."""
        if not self.is_moe:
            return self.num_params
        unused = self.expert_params * (self.num_experts - self.experts_per_token) / self.num_experts
        return self.num_params - round(unused)

    @property
    def largest_tensor_params(self) -> int:
        """The largest single parameter: the embedding, the head, a linear's weight or a fused expert tensor."""
        linear = max((lin.in_features * lin.out_features for lin in self.decoder_linears), default=0)
        gate_up = self.num_experts * 2 * self.hidden_size * self.moe_intermediate_size
        return max(self.embedding_params, self.lm_head_params, linear, gate_up)

    def layer_count(self, attention: str) -> int:
        """Decoder layers of one attention kind (full_attention, sliding_attention, linear_attention, ...)."""
        return sum(n for n, shape in self.layer_kinds if shape.attention == attention)

    def cache_elements(self, tokens: float) -> float:
        """What generation keeps per sequence after `tokens` tokens, in elements, over all layers: keys and values
        (within the window for sliding layers), MLA's compressed latent, or a linear-attention layer's state."""
        return sum(n * cache_elements(self, shape.attention, tokens) for n, shape in self.layer_kinds)


def _shape_problems(facts: ModelFacts) -> list[str]:
    """Every reason the facts cannot describe a model, all at once."""
    problems = []
    positive = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_attention_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    )
    problems += [
        f"{key} must be a positive integer, got {getattr(facts, key)!r}"
        for key in positive
        if not _positive_int(getattr(facts, key))
    ]
    if facts.mlp not in MLP_KINDS:
        problems.append(f"mlp must be one of {MLP_KINDS}, got {facts.mlp!r}")
    if facts.norm not in NORM_KINDS:
        problems.append(f"norm must be one of {NORM_KINDS}, got {facts.norm!r}")
    if facts.num_experts and not (facts.experts_per_token > 0 and facts.moe_intermediate_size > 0):
        problems.append("an MoE model (num_experts > 0) needs experts_per_token and moe_intermediate_size > 0")
    for key in ("aliases", "layer_types", "dense_layers"):
        if not isinstance(getattr(facts, key), tuple):
            problems.append(f"{key} must be a tuple")
    return problems


def _layer_problems(facts: ModelFacts) -> list[str]:
    """What makes the per-layer facts inconsistent (layer kinds, MLA and linear-attention sizes)."""
    if not isinstance(facts.layer_types, tuple) or not isinstance(facts.dense_layers, tuple):
        return []
    problems = []
    if facts.layer_types and len(facts.layer_types) != facts.num_layers:
        problems.append(f"layer_types names {len(facts.layer_types)} layers, the model has {facts.num_layers}")
    unknown = sorted(set(facts.layer_types) - set(ATTENTION_KINDS))
    if unknown:
        problems.append(f"layer_types has {unknown}; known kinds: {', '.join(ATTENTION_KINDS)}")
    if any(not 0 <= i < facts.num_layers for i in facts.dense_layers):
        problems.append(f"dense_layers must be layer indices below {facts.num_layers}")
    if facts.kv_lora_rank and not (0 < facts.qk_rope_head_dim < facts.head_dim and facts.v_head_dim > 0):
        problems.append("MLA (kv_lora_rank > 0) needs 0 < qk_rope_head_dim < head_dim and v_head_dim > 0")
    linear = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    if LINEAR_ATTENTION in facts.layer_types and not all(getattr(facts, k) > 0 for k in linear):
        problems.append("linear-attention layers need " + ", ".join(linear) + " > 0")
    return problems


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
