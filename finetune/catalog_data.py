"""The catalog's rules (read by finetune.catalog): which parameters each model_type creates, read from its config.

The table itself is data: finetune/catalog.yaml, one list item per distinct architecture, its values under the
names config.json gives them (so a row reads against the published file key by key), with the row's `source`.
Instruct or chat releases with the same config are `aliases`; a release whose config differs (vocab size, max
positions) is one of the row's `variants`, which lists only what differs. A row is read exactly like a local
config.json: `layout(model_type, config)` turns it into ModelFacts fields, and tests/test_catalog.py checks every
row's counts against transformers' meta-device build of the same config.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from finetune.catalog_layers import CHUNKED, FULL, LINEAR_ATTENTION, SLIDING

ROW_KEYS = ("name", "aliases", "source", "variants")  # a row's own keys; every other key is a config.json value


def first(cfg: dict, keys: tuple[str, ...]) -> Any:
    """The value of the first of `keys` that `cfg` sets (not None); None where it sets none."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


# --- Which parameters each model_type creates, as ModelFacts fields read from its config ---
# (the ModelFacts defaults, a gated MLP, RMS norms and no biases, fill the rest)


def _llama_like(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias"))  # llama-style: one flag for q, k, v and o
    return {"attention_bias": bias, "o_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias"))}


def _experts(cfg: dict) -> int:
    return cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0


def _moe(cfg: dict, expert_size_key: str = "moe_intermediate_size") -> dict:
    experts = _experts(cfg)
    if not experts:
        return {}
    return {
        "num_experts": experts,
        "experts_per_token": cfg.get("num_experts_per_tok") or cfg.get("top_k_experts") or 1,
        "moe_intermediate_size": cfg.get(expert_size_key) or cfg.get("intermediate_size"),
    }


def _sparse_step_dense_layers(cfg: dict) -> tuple[int, ...]:
    """Qwen's rule: a layer is dense if listed in mlp_only_layers or off the decoder_sparse_step grid."""
    only, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step)


def _qwen3_moe(cfg: dict) -> dict:
    moe = _moe(cfg)
    return {"qk_norm": True, **_llama_like(cfg), **moe, "dense_layers": _sparse_step_dense_layers(cfg) if moe else ()}


def _phi(cfg: dict) -> dict:
    return {
        "mlp": "plain",
        "norm": "layer",
        "norms_per_layer": 1,
        "attention_bias": True,
        "o_bias": True,
        "mlp_bias": True,
        "lm_head_bias": True,
        "counts_exact": not cfg.get("qk_layernorm"),
    }


def _stablelm(cfg: dict) -> dict:
    return {
        "norm": "layer",
        "attention_bias": bool(cfg.get("use_qkv_bias")),
        "norms_per_layer": 1 if cfg.get("use_parallel_residual") else 2,
        "counts_exact": not cfg.get("qk_layernorm"),
    }


def _periodic_types(cfg: dict, every: int, rest: str, default_every: int | None = None) -> tuple[str, ...]:
    """The config's layer_types, or its rule: every `every`-th layer full attention, the others `rest`."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    every = every or default_every or 1
    return tuple(FULL if (i + 1) % every == 0 else rest for i in range(cfg["num_hidden_layers"]))


def _checkpoint_format(cfg: dict) -> dict:
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    return {"checkpoint_quantization": str(method)} if method else {}


def _gated_delta_net(cfg: dict, fused: bool) -> dict:
    """Qwen3-Next and Qwen3.5: gated DeltaNet layers with one gated full-attention layer in every few."""
    return {
        "qk_norm": True,
        "query_gate": True,
        **_llama_like(cfg),
        "layer_types": _periodic_types(cfg, cfg.get("full_attention_interval"), LINEAR_ATTENTION, 4),
        "linear_key_heads": cfg.get("linear_num_key_heads") or 16,
        "linear_value_heads": cfg.get("linear_num_value_heads") or 32,
        "linear_key_head_dim": cfg.get("linear_key_head_dim") or 128,
        "linear_value_head_dim": cfg.get("linear_value_head_dim") or 128,
        "linear_conv_kernel": cfg.get("linear_conv_kernel_dim") or 4,
        "linear_fused_proj": fused,
    }


def _qwen_shared_expert(cfg: dict) -> dict:
    return {
        **_moe(cfg),
        "shared_expert_size": cfg.get("shared_expert_intermediate_size") or 0,
        "shared_expert_gate": True,
    }


def _qwen3_next(cfg: dict) -> dict:
    moe = _qwen_shared_expert(cfg) if _experts(cfg) else {}
    return {**_gated_delta_net(cfg, fused=True), **moe, "dense_layers": _sparse_step_dense_layers(cfg) if moe else ()}


def _gpt_oss(cfg: dict) -> dict:
    bias = cfg.get("attention_bias", True)
    return {
        "attention_bias": bias,
        "o_bias": bias,
        "attention_sinks": True,
        **_moe(cfg, "intermediate_size"),
        "router_bias": True,
        "expert_bias": True,
        "layer_types": _periodic_types(cfg, 2, SLIDING),
        "sliding_window": cfg.get("sliding_window") or 0,
        **_checkpoint_format(cfg),
    }


def _deepseek_v3(cfg: dict) -> dict:
    """Multi-head latent attention, routed experts with shared ones, the first layers dense."""
    rope, nope = cfg.get("qk_rope_head_dim") or 64, cfg.get("qk_nope_head_dim") or 128
    moe = _moe(cfg)
    return {
        "attention_bias": bool(cfg.get("attention_bias")),
        "o_bias": bool(cfg.get("attention_bias")),
        "head_dim": nope + rope,
        "q_lora_rank": cfg.get("q_lora_rank", 1536) or 0,  # None: queries without a latent
        "kv_lora_rank": cfg.get("kv_lora_rank") or 512,
        "qk_rope_head_dim": rope,
        "v_head_dim": cfg.get("v_head_dim") or 128,
        **moe,
        "shared_expert_size": (cfg.get("n_shared_experts", 1) or 0) * (cfg.get("moe_intermediate_size") or 2048),
        "dense_layers": tuple(range(min(cfg.get("first_k_dense_replace", 3) or 0, cfg["num_hidden_layers"]))),
        **_checkpoint_format(cfg),
    }


def _llama4_text(cfg: dict) -> dict:
    """Llama 4: experts of intermediate_size plus a shared expert of that size; dense layers of intermediate_size_mlp
    where moe_layers (or interleave_moe_layer_step) leaves them; chunked attention in the layers with RoPE."""
    layers, step = cfg["num_hidden_layers"], cfg.get("interleave_moe_layer_step") or 1
    moe_layers = set(cfg.get("moe_layers") or range(step - 1, layers, step))
    interval, chunk = cfg.get("no_rope_layer_interval") or 4, cfg.get("attention_chunk_size")
    no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    types = cfg.get("layer_types") or [CHUNKED if uses_rope and chunk else FULL for uses_rope in no_rope]
    return {
        **_llama_like(cfg),
        "intermediate_size": cfg.get("intermediate_size_mlp") or 16384,
        **_moe(cfg, "intermediate_size"),
        "shared_expert_size": cfg.get("intermediate_size") or 8192,
        "router_linear": "router",
        "dense_layers": tuple(i for i in range(layers) if i not in moe_layers),
        "layer_types": tuple(types),
        "sliding_window": chunk or 0,
    }


def _gemma4_global_attention(cfg: dict) -> dict:
    """Gemma 4's full-attention layers: their own head size and key/value heads, keys doubling as values."""
    per_layer = cfg.get("per_layer_config") or {}  # a loaded config's form of the same values
    first = next(iter(per_layer.values()), {})
    k_is_v = bool(cfg.get("attention_k_eq_v"))
    kv_heads = cfg.get("num_global_key_value_heads") if k_is_v else None
    return {
        "global_head_dim": first.get("head_dim") or cfg.get("global_head_dim") or 512,
        "global_kv_heads": first.get("num_key_value_heads") or kv_heads or 0,
        "global_k_is_v": k_is_v,
    }


def _gemma4_text(cfg: dict) -> dict:
    """Gemma 4: four norms a layer, five sliding layers to one full; the MoE block runs beside the dense MLP with a
    router of its own (a linear, a scale per input and per expert) and three more norms. Per-layer input embeddings
    and key/value sharing (the E2B/E4B releases) are not counted exactly."""
    moe = {}
    if cfg.get("enable_moe_block"):
        moe = {**_moe(cfg), "moe_dense_mlp": True, "router_linear": "proj", "moe_norms": 4, "expert_scale": True}
    per_layer_inputs = cfg.get("hidden_size_per_layer_input", 256) or cfg.get("num_kv_shared_layers")
    types = _periodic_types(cfg, 6, SLIDING)
    return {
        "norms_per_layer": 4,
        "qk_norm": True,
        **_llama_like(cfg),
        "o_bias": bool(cfg.get("attention_bias")),
        "layer_types": types[:-1] + (FULL,),  # transformers makes the last layer full attention, whatever it is given
        "sliding_window": cfg.get("sliding_window") or 512,
        **_gemma4_global_attention(cfg),
        **moe,
        "counts_exact": not (per_layer_inputs or cfg.get("use_double_wide_mlp")),
    }


LAYOUTS = {
    "llama": _llama_like,
    "smollm3": _llama_like,  # its NoPE layers change no parameters
    "mistral": lambda cfg: {},
    "mixtral": lambda cfg: _moe(cfg, "intermediate_size"),  # each expert is a full-size MLP
    "qwen2": lambda cfg: {"attention_bias": True},  # q, k, v biases always; none on o
    "qwen3": lambda cfg: {"qk_norm": True, **_llama_like(cfg)},
    "qwen3_moe": _qwen3_moe,
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": lambda cfg: _gated_delta_net(cfg, fused=False),
    "qwen3_5_moe_text": lambda cfg: {**_gated_delta_net(cfg, fused=False), **_qwen_shared_expert(cfg)},
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "llama4_text": _llama4_text,
    "gemma": _llama_like,
    "gemma2": lambda cfg: {"norms_per_layer": 4, **_llama_like(cfg)},
    "gemma3_text": lambda cfg: {"norms_per_layer": 4, "qk_norm": True, **_llama_like(cfg)},
    "gemma4_text": _gemma4_text,
    "phi": _phi,
    "phi3": lambda cfg: {"fused_qkv": True, "fused_gate_up": True},
    "stablelm": _stablelm,
}


# Multimodal configs that nest the language model in "text_config", and the text model's type.
TEXT_MODEL_TYPES = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "llama4": "llama4_text",
}
# Where config.json omits tie_word_embeddings, transformers ties the head for these types only.
TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3_text", "gemma4_text", "smollm3"})
# The keys that may spell each shape field (GPT-style names too), in order of preference.
KEY_SPELLINGS = {
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}


def layout(model_type: str, cfg: dict) -> dict:
    """The ModelFacts fields `model_type` derives from `cfg`; an unknown type is read as llama-like, not exactly."""
    if model_type in LAYOUTS:
        return LAYOUTS[model_type](cfg)
    return {**_llama_like(cfg), **_moe(cfg), "counts_exact": False}


# --- The table (finetune/catalog.yaml) ---


def catalog_rows() -> tuple[dict, ...]:
    """Every entry of catalog.yaml, each variant expanded into a row of its own (its base's values, then its own)."""
    text = resources.files("finetune").joinpath("catalog.yaml").read_text(encoding="utf-8")
    rows = []
    for row in yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml's, where installed
        base = {k: v for k, v in row.items() if k != "variants"}
        rows.append(base)
        rows += [{**base, "aliases": [], **variant} for variant in row.get("variants", ())]
    return tuple(rows)


def row_config(row: dict) -> dict:
    """A catalog row's config.json values (everything but its name, aliases, source and variants)."""
    return {k: v for k, v in row.items() if k not in ROW_KEYS}
