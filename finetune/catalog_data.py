"""The catalog's data (read by finetune.catalog): which parameters each model_type creates, and
a table of config.json values of popular open models.

One row per distinct architecture. Instruct or chat releases with the same config are aliases;
a release whose config differs (vocab size, max positions) is its own entry, built as a variant.
Values come from the models' published config.json files; tests/test_catalog.py checks each
entry's parameter count against transformers on the meta device.
"""

from __future__ import annotations

# --- Which parameters each model_type creates, as ModelFacts switches read from its config ---
# (the ModelFacts defaults, a gated MLP, RMS norms and no biases, fill the rest)


def _llama_like(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias"))  # llama-style: one flag for q, k, v and o
    return {"attention_bias": bias, "o_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias"))}


def _moe(cfg: dict, expert_size_key: str = "moe_intermediate_size") -> dict:
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return {}
    return {
        "num_experts": experts,
        "experts_per_token": cfg.get("num_experts_per_tok") or 1,
        "moe_intermediate_size": cfg.get(expert_size_key) or cfg.get("intermediate_size"),
    }


def _qwen3_moe(cfg: dict) -> dict:
    every_layer_sparse = not cfg.get("mlp_only_layers") and cfg.get("decoder_sparse_step", 1) == 1
    return {"qk_norm": True, **_llama_like(cfg), **_moe(cfg), "counts_exact": every_layer_sparse}


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


LAYOUTS = {
    "llama": _llama_like,
    "mistral": lambda cfg: {},
    "mixtral": lambda cfg: _moe(cfg, "intermediate_size"),  # each expert is a full-size MLP
    "qwen2": lambda cfg: {"attention_bias": True},  # q, k, v biases always; none on o
    "qwen3": lambda cfg: {"qk_norm": True, **_llama_like(cfg)},
    "qwen3_moe": _qwen3_moe,
    "gemma": _llama_like,
    "gemma2": lambda cfg: {"norms_per_layer": 4, **_llama_like(cfg)},
    "gemma3_text": lambda cfg: {"norms_per_layer": 4, "qk_norm": True, **_llama_like(cfg)},
    "phi": _phi,
    "phi3": lambda cfg: {"fused_qkv": True, "fused_gate_up": True},
    "stablelm": _stablelm,
}


# Multimodal configs that nest the language model in "text_config", and the text model's type.
TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Where config.json omits tie_word_embeddings, transformers ties the head for these types only.
TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3_text"})
# The keys that may spell each shape field (GPT-style names too), in order of preference.
KEY_SPELLINGS = {
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}


def layout(model_type: str, cfg: dict) -> dict:
    """The switches for `model_type`; an unknown type is read as llama-like, not exactly."""
    if model_type in LAYOUTS:
        return LAYOUTS[model_type](cfg)
    return {**_llama_like(cfg), **_moe(cfg), "counts_exact": False}


def _family(model_type: str, **cfg) -> dict:
    return {"model_type": model_type, **layout(model_type, cfg)}


# --- The table ---

LLAMA = _family("llama")
MISTRAL = _family("mistral")
MIXTRAL = {**_family("mixtral"), "num_experts": 8, "experts_per_token": 2}
QWEN2 = _family("qwen2")
QWEN3 = _family("qwen3")
QWEN3_MOE = _family("qwen3_moe")
GEMMA2 = _family("gemma2")
# Gemma 3 4B and up are multimodal (model_type "gemma3"); the catalog describes their text tower
# (Gemma3TextConfig, model_type "gemma3_text"), which is what ft fine-tunes. 1B is text-only.
GEMMA3 = _family("gemma3_text")
PHI = _family("phi")
PHI3 = _family("phi3")
STABLELM = _family("stablelm")
STABLELM_QKV_BIAS = _family("stablelm", use_qkv_bias=True)


def _rows(
    family: dict,
    name: str,
    vocab: int,
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tied: bool,
    max_pos: int,
    aliases: tuple[str, ...] = (),
    variants: tuple[tuple[str, dict], ...] = (),
    **extra,
) -> tuple[dict, ...]:
    """One entry, plus one per (name, overrides) variant whose config differs from it."""
    base = {
        **family,
        "name": name,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "tie_word_embeddings": tied,
        "max_position_embeddings": max_pos,
        "aliases": aliases,
        **extra,
    }
    return (base, *({**base, "name": v, "aliases": (), **overrides} for v, overrides in variants))


def _max_pos_variant(name: str, max_pos: int) -> tuple[tuple[str, dict], ...]:
    return ((name, {"max_position_embeddings": max_pos}),)


def _meta(*names: str) -> tuple[str, ...]:
    return tuple(f"meta-llama/{n}" for n in names)


_ROWS = (
    # family, name, vocab, hidden, intermediate, layers, heads, kv heads, head_dim, tied, max pos
    _rows(LLAMA, "ft-tiny", 512, 128, 384, 4, 4, 2, 32, True, 512, aliases=("tiny",)),
    # Llama 2
    _rows(
        LLAMA,
        "meta-llama/Llama-2-7b-hf",
        32000,
        4096,
        11008,
        32,
        32,
        32,
        128,
        False,
        4096,
        aliases=_meta("Llama-2-7b", "Llama-2-7b-chat-hf", "Llama-2-7b-chat"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-2-13b-hf",
        32000,
        5120,
        13824,
        40,
        40,
        40,
        128,
        False,
        4096,
        aliases=_meta("Llama-2-13b", "Llama-2-13b-chat-hf", "Llama-2-13b-chat"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-2-70b-hf",
        32000,
        8192,
        28672,
        80,
        64,
        8,
        128,
        False,
        4096,
        aliases=_meta("Llama-2-70b", "Llama-2-70b-chat-hf", "Llama-2-70b-chat"),
    ),
    # Llama 3, 3.1, 3.2, 3.3
    _rows(
        LLAMA,
        "meta-llama/Meta-Llama-3-8B",
        128256,
        4096,
        14336,
        32,
        32,
        8,
        128,
        False,
        8192,
        aliases=_meta("Meta-Llama-3-8B-Instruct"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Meta-Llama-3-70B",
        128256,
        8192,
        28672,
        80,
        64,
        8,
        128,
        False,
        8192,
        aliases=_meta("Meta-Llama-3-70B-Instruct"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-3.1-8B",
        128256,
        4096,
        14336,
        32,
        32,
        8,
        128,
        False,
        131072,
        aliases=_meta("Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-3.1-70B",
        128256,
        8192,
        28672,
        80,
        64,
        8,
        128,
        False,
        131072,
        aliases=_meta("Llama-3.1-70B-Instruct", "Meta-Llama-3.1-70B", "Meta-Llama-3.1-70B-Instruct"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-3.1-405B",
        128256,
        16384,
        53248,
        126,
        128,
        8,
        128,
        False,
        131072,
        aliases=_meta("Llama-3.1-405B-Instruct", "Meta-Llama-3.1-405B", "Meta-Llama-3.1-405B-Instruct"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-3.2-1B",
        128256,
        2048,
        8192,
        16,
        32,
        8,
        64,
        True,
        131072,
        aliases=_meta("Llama-3.2-1B-Instruct"),
    ),
    _rows(
        LLAMA,
        "meta-llama/Llama-3.2-3B",
        128256,
        3072,
        8192,
        28,
        24,
        8,
        128,
        True,
        131072,
        aliases=_meta("Llama-3.2-3B-Instruct"),
    ),
    _rows(LLAMA, "meta-llama/Llama-3.3-70B-Instruct", 128256, 8192, 28672, 80, 64, 8, 128, False, 131072),
    # Mistral, Mixtral
    _rows(
        MISTRAL,
        "mistralai/Mistral-7B-v0.1",
        32000,
        4096,
        14336,
        32,
        32,
        8,
        128,
        False,
        32768,
        aliases=("mistralai/Mistral-7B-Instruct-v0.1", "mistralai/Mistral-7B-Instruct-v0.2"),
    ),
    _rows(
        MISTRAL,
        "mistralai/Mistral-7B-v0.3",
        32768,
        4096,
        14336,
        32,
        32,
        8,
        128,
        False,
        32768,
        aliases=("mistralai/Mistral-7B-Instruct-v0.3",),
    ),
    _rows(
        MISTRAL,
        "mistralai/Mistral-Nemo-Base-2407",
        131072,
        5120,
        14336,
        40,
        32,
        8,
        128,
        False,
        128000,
        variants=_max_pos_variant("mistralai/Mistral-Nemo-Instruct-2407", 1024000),
    ),
    _rows(
        MIXTRAL,
        "mistralai/Mixtral-8x7B-v0.1",
        32000,
        4096,
        14336,
        32,
        32,
        8,
        128,
        False,
        32768,
        aliases=("mistralai/Mixtral-8x7B-Instruct-v0.1",),
        moe_intermediate_size=14336,
    ),
    _rows(
        MIXTRAL,
        "mistralai/Mixtral-8x22B-v0.1",
        32000,
        6144,
        16384,
        56,
        48,
        8,
        128,
        False,
        65536,
        aliases=("mistral-community/Mixtral-8x22B-v0.1",),
        moe_intermediate_size=16384,
        variants=(("mistralai/Mixtral-8x22B-Instruct-v0.1", {"vocab_size": 32768}),),
    ),
    # Qwen2.5 (base and instruct differ only in max positions for 1.5B and 7B and up)
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-0.5B",
        151936,
        896,
        4864,
        24,
        14,
        2,
        64,
        True,
        32768,
        aliases=("Qwen/Qwen2.5-0.5B-Instruct",),
    ),
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-1.5B",
        151936,
        1536,
        8960,
        28,
        12,
        2,
        128,
        True,
        131072,
        variants=_max_pos_variant("Qwen/Qwen2.5-1.5B-Instruct", 32768),
    ),
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-3B",
        151936,
        2048,
        11008,
        36,
        16,
        2,
        128,
        True,
        32768,
        aliases=("Qwen/Qwen2.5-3B-Instruct",),
    ),
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-7B",
        152064,
        3584,
        18944,
        28,
        28,
        4,
        128,
        False,
        131072,
        variants=_max_pos_variant("Qwen/Qwen2.5-7B-Instruct", 32768),
    ),
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-14B",
        152064,
        5120,
        13824,
        48,
        40,
        8,
        128,
        False,
        131072,
        variants=_max_pos_variant("Qwen/Qwen2.5-14B-Instruct", 32768),
    ),
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-32B",
        152064,
        5120,
        27648,
        64,
        40,
        8,
        128,
        False,
        131072,
        variants=_max_pos_variant("Qwen/Qwen2.5-32B-Instruct", 32768),
    ),
    _rows(
        QWEN2,
        "Qwen/Qwen2.5-72B",
        152064,
        8192,
        29568,
        80,
        64,
        8,
        128,
        False,
        131072,
        variants=_max_pos_variant("Qwen/Qwen2.5-72B-Instruct", 32768),
    ),
    # Qwen3 (the un-suffixed names are the post-trained models; "-Base" is the pretrained one)
    _rows(
        QWEN3,
        "Qwen/Qwen3-0.6B",
        151936,
        1024,
        3072,
        28,
        16,
        8,
        128,
        True,
        40960,
        variants=_max_pos_variant("Qwen/Qwen3-0.6B-Base", 32768),
    ),
    _rows(
        QWEN3,
        "Qwen/Qwen3-1.7B",
        151936,
        2048,
        6144,
        28,
        16,
        8,
        128,
        True,
        40960,
        variants=_max_pos_variant("Qwen/Qwen3-1.7B-Base", 32768),
    ),
    _rows(
        QWEN3,
        "Qwen/Qwen3-4B",
        151936,
        2560,
        9728,
        36,
        32,
        8,
        128,
        True,
        40960,
        variants=_max_pos_variant("Qwen/Qwen3-4B-Base", 32768),
    ),
    _rows(
        QWEN3,
        "Qwen/Qwen3-8B",
        151936,
        4096,
        12288,
        36,
        32,
        8,
        128,
        False,
        40960,
        variants=_max_pos_variant("Qwen/Qwen3-8B-Base", 32768),
    ),
    _rows(
        QWEN3,
        "Qwen/Qwen3-14B",
        151936,
        5120,
        17408,
        40,
        40,
        8,
        128,
        False,
        40960,
        variants=_max_pos_variant("Qwen/Qwen3-14B-Base", 32768),
    ),
    _rows(QWEN3, "Qwen/Qwen3-32B", 151936, 5120, 25600, 64, 64, 8, 128, False, 40960),
    _rows(
        QWEN3_MOE,
        "Qwen/Qwen3-30B-A3B",
        151936,
        2048,
        6144,
        48,
        32,
        4,
        128,
        False,
        40960,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
        variants=_max_pos_variant("Qwen/Qwen3-30B-A3B-Base", 32768),
    ),
    # Gemma 2 and 3
    _rows(
        GEMMA2, "google/gemma-2-2b", 256000, 2304, 9216, 26, 8, 4, 256, True, 8192, aliases=("google/gemma-2-2b-it",)
    ),
    _rows(
        GEMMA2, "google/gemma-2-9b", 256000, 3584, 14336, 42, 16, 8, 256, True, 8192, aliases=("google/gemma-2-9b-it",)
    ),
    _rows(
        GEMMA2,
        "google/gemma-2-27b",
        256000,
        4608,
        36864,
        46,
        32,
        16,
        128,
        True,
        8192,
        aliases=("google/gemma-2-27b-it",),
    ),
    _rows(
        GEMMA3,
        "google/gemma-3-1b-pt",
        262144,
        1152,
        6912,
        26,
        4,
        1,
        256,
        True,
        32768,
        aliases=("google/gemma-3-1b-it",),
    ),
    _rows(
        GEMMA3,
        "google/gemma-3-4b-pt",
        262208,
        2560,
        10240,
        34,
        8,
        4,
        256,
        True,
        131072,
        aliases=("google/gemma-3-4b-it",),
    ),
    _rows(
        GEMMA3,
        "google/gemma-3-12b-pt",
        262208,
        3840,
        15360,
        48,
        16,
        8,
        256,
        True,
        131072,
        aliases=("google/gemma-3-12b-it",),
    ),
    _rows(
        GEMMA3,
        "google/gemma-3-27b-pt",
        262208,
        5376,
        21504,
        62,
        32,
        16,
        128,
        True,
        131072,
        aliases=("google/gemma-3-27b-it",),
    ),
    # Phi
    _rows(PHI, "microsoft/phi-1_5", 51200, 2048, 8192, 24, 32, 32, 64, False, 2048),
    _rows(PHI, "microsoft/phi-2", 51200, 2560, 10240, 32, 32, 32, 80, False, 2048),
    _rows(
        PHI3,
        "microsoft/Phi-3-mini-4k-instruct",
        32064,
        3072,
        8192,
        32,
        32,
        32,
        96,
        False,
        4096,
        variants=_max_pos_variant("microsoft/Phi-3-mini-128k-instruct", 131072),
    ),
    _rows(
        PHI3,
        "microsoft/Phi-3-medium-4k-instruct",
        32064,
        5120,
        17920,
        40,
        40,
        10,
        128,
        False,
        4096,
        variants=_max_pos_variant("microsoft/Phi-3-medium-128k-instruct", 131072),
    ),
    _rows(PHI3, "microsoft/Phi-3.5-mini-instruct", 32064, 3072, 8192, 32, 32, 32, 96, False, 131072),
    _rows(PHI3, "microsoft/phi-4", 100352, 5120, 17920, 40, 40, 10, 128, False, 16384),
    # SmolLM2, Yi, StableLM
    _rows(
        LLAMA,
        "HuggingFaceTB/SmolLM2-135M",
        49152,
        576,
        1536,
        30,
        9,
        3,
        64,
        True,
        8192,
        aliases=("HuggingFaceTB/SmolLM2-135M-Instruct",),
    ),
    _rows(
        LLAMA,
        "HuggingFaceTB/SmolLM2-360M",
        49152,
        960,
        2560,
        32,
        15,
        5,
        64,
        True,
        8192,
        aliases=("HuggingFaceTB/SmolLM2-360M-Instruct",),
    ),
    _rows(
        LLAMA,
        "HuggingFaceTB/SmolLM2-1.7B",
        49152,
        2048,
        8192,
        24,
        32,
        32,
        64,
        True,
        8192,
        aliases=("HuggingFaceTB/SmolLM2-1.7B-Instruct",),
    ),
    _rows(LLAMA, "01-ai/Yi-6B", 64000, 4096, 11008, 32, 32, 4, 128, False, 4096, aliases=("01-ai/Yi-6B-Chat",)),
    _rows(LLAMA, "01-ai/Yi-34B", 64000, 7168, 20480, 60, 56, 8, 128, False, 4096, aliases=("01-ai/Yi-34B-Chat",)),
    _rows(STABLELM_QKV_BIAS, "stabilityai/stablelm-2-1_6b", 100352, 2048, 5632, 24, 32, 32, 64, False, 4096),
    _rows(STABLELM, "stabilityai/stablelm-3b-4e1t", 50304, 2560, 6912, 32, 32, 32, 80, False, 4096),
)

ENTRIES: tuple[dict, ...] = tuple(entry for rows in _ROWS for entry in rows)
