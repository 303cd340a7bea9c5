"""finetune.catalog: every entry's counts against transformers on the meta device, plus lookup,
suggestions, config.json parsing and resolution order."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import dataclasses
import functools
import pickle
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, LlamaConfig, Qwen2Config

from finetune.catalog import (
    CATALOG,
    EXACT_MODEL_TYPES,
    Linear,
    ModelFacts,
    ModelNotFound,
    catalog_config,
    from_hf_config,
    lookup,
    resolve,
    suggest,
    to_hf_config,
)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
)


# ----------------------------------------------------------------------------- helpers


def _meta_model(model_type: str, cfg: dict) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@functools.cache
def _entry_model(name: str) -> torch.nn.Module:
    """transformers' model of a catalog entry's own config (its catalog.yaml row), on the meta device."""
    config = catalog_config(name)
    config.pop("quantization_config", None)  # the published weights' format, not the architecture
    return _meta_model(config.pop("model_type"), config)


def _count(params) -> int:
    return sum(p.numel() for p in params)


def _real_linears(layer: torch.nn.Module) -> list[tuple[str, int, int, bool]]:
    return sorted(
        (name.rsplit(".", 1)[-1], mod.in_features, mod.out_features, mod.bias is not None)
        for name, mod in layer.named_modules()
        if isinstance(mod, torch.nn.Linear)
    )


def _fact_linears(facts: ModelFacts) -> list[tuple[str, int, int, bool]]:
    return sorted(
        (lin.name, lin.in_features, lin.out_features, lin.bias)
        for lin in facts.layer_linears()
        for _ in range(lin.count)
    )


def _all_real_linears(model: torch.nn.Module) -> dict[tuple[str, int, int, bool], int]:
    """Every decoder linear by (name, in, out, bias) -> how many there are in all layers."""
    counts: dict[tuple[str, int, int, bool], int] = {}
    for layer in model.model.layers:
        for key in _real_linears(layer):
            counts[key] = counts.get(key, 0) + 1
    return counts


def _real_breakdown(model: torch.nn.Module) -> dict[str, int]:
    layers = model.model.layers
    named = dict(model.named_parameters())  # tied weights appear once, under the embedding
    return {
        "num_params": _count(model.parameters()),
        "embedding_params": model.get_input_embeddings().weight.numel(),
        "lm_head_params": _count(p for n, p in named.items() if n.startswith("lm_head.")),
        "linear_params": _count(p for m in layers.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()),
        "expert_params": _count(p for n, p in layers.named_parameters() if ".experts." in n),
        "layer_params": max(_count(layer.parameters()) for layer in layers),  # the largest: what FSDP gathers
        "decoder_params": _count(layers.parameters()),
    }


def _fact_breakdown(facts: ModelFacts) -> dict[str, int]:
    keys = ("num_params", "embedding_params", "lm_head_params", "linear_params", "expert_params", "layer_params")
    return {key: getattr(facts, key) for key in (*keys, "decoder_params")}


# ----------------------------------------------------------------------------- every entry

KNOWN_TO_TRANSFORMERS = [f for f in CATALOG if f.model_type in EXACT_MODEL_TYPES]


def test_every_entry_has_a_layout_transformers_knows():
    assert KNOWN_TO_TRANSFORMERS == list(CATALOG)
    assert all(f.counts_exact for f in CATALOG)


@pytest.mark.parametrize("facts", KNOWN_TO_TRANSFORMERS, ids=lambda f: f.name)
def test_entry_counts_match_transformers(facts: ModelFacts):
    model = _entry_model(facts.name)
    assert _fact_breakdown(facts) == _real_breakdown(model)
    assert facts.other_params == facts.num_params - (
        facts.embedding_params + facts.lm_head_params + facts.linear_params + facts.expert_params
    )


@pytest.mark.parametrize("facts", KNOWN_TO_TRANSFORMERS, ids=lambda f: f.name)
def test_entry_layer_linears_match_layer_0(facts: ModelFacts):
    model = _entry_model(facts.name)
    assert _fact_linears(facts) == _real_linears(model.model.layers[0])


@pytest.mark.parametrize("facts", [f for f in CATALOG if f.layer_types or f.dense_layers], ids=lambda f: f.name)
def test_entry_linears_match_every_layer(facts: ModelFacts):
    """Models whose layers differ (hybrid attention, dense layers among MoE ones): every layer's linears, not just
    layer 0's, as LoRA and bitsandbytes see them."""
    merged = {(lin.name, lin.in_features, lin.out_features, lin.bias): lin.count for lin in facts.decoder_linears}
    assert merged == _all_real_linears(_entry_model(facts.name))


@pytest.mark.parametrize(
    "name, published",
    [
        ("meta-llama/Llama-3.1-8B", 8_030_261_248),
        ("meta-llama/Llama-2-7b-hf", 6_738_415_616),
        ("mistralai/Mistral-7B-v0.1", 7_241_732_096),
        # the counts below are published in keras-hub's preset metadata
        ("Qwen/Qwen2.5-7B", 7_615_616_512),
        ("Qwen/Qwen3-8B", 8_190_735_360),
        ("google/gemma-2-9b", 9_241_705_984),
        ("google/gemma-3-1b-pt", 999_885_952),
        ("microsoft/Phi-3-mini-4k-instruct", 3_821_079_552),
    ],
)
def test_published_parameter_counts(name: str, published: int):
    assert lookup(name).num_params == published


@pytest.mark.parametrize(
    "name, total, active, digits",
    [
        # OpenAI's gpt-oss model card (Table 1: total and active parameters, the embedding not counted as active)
        ("openai/gpt-oss-20b", 20.91e9, 3.61e9, 4),
        ("openai/gpt-oss-120b", 116.83e9, 5.13e9, 5),
        # DeepSeek-V3's README: 671B for the main model (its 14B multi-token-prediction module apart), 37B activated
        ("deepseek-ai/DeepSeek-V3", 671e9, 37e9, 3),
        # the Qwen3 model cards: "30.5B in total and 3.3B activated", "235B in total and 22B activated"
        ("Qwen/Qwen3-30B-A3B", 30.5e9, 3.3e9, 3),
        ("Qwen/Qwen3-235B-A22B", 235e9, 22e9, 3),
    ],
)
def test_published_moe_totals_and_active_parameters(name: str, total: float, active: float, digits: int):
    """Memory holds all experts; a token computes with the router's picks only (plus everything that is not an
    expert), to the vendors' rounding; OpenAI leaves the embedding table out of its active count."""
    facts = lookup(name)
    assert float(f"{facts.num_params:.{digits}g}") == total
    counted = facts.active_params - (facts.embedding_params if name.startswith("openai/") else 0)
    assert counted == pytest.approx(active, rel=0.025)


def test_mla_caches_the_compressed_latent():
    """DeepSeek-V3 caches kv_lora_rank + qk_rope_head_dim values per token and layer (transformers caches the latent
    before expanding it), not keys and values of 128 heads."""
    facts = lookup("deepseek-ai/DeepSeek-V3")
    assert facts.is_mla and facts.cache_elements(1000) == 61 * (512 + 64) * 1000
    assert facts.cache_elements(1000) < 2 * 61 * 128 * 128 * 1000 / 50


def test_linear_attention_and_sliding_layers_stop_growing():
    """Only full-attention layers cache every token: a gated DeltaNet layer keeps a fixed state, a sliding layer its
    window."""
    qwen = lookup("Qwen/Qwen3.5-35B-A3B")
    full = qwen.layer_count("full_attention")
    assert (full, qwen.layer_count("linear_attention")) == (10, 30)
    assert qwen.cache_elements(2000) - qwen.cache_elements(1000) == full * 2 * 2 * 256 * 1000
    oss = lookup("openai/gpt-oss-20b")
    grown = oss.cache_elements(2000) - oss.cache_elements(1000)
    assert (
        grown == oss.layer_count("full_attention") * 2 * oss.kv_dim * 1000 and oss.layer_count("full_attention") == 12
    )


def test_dense_layers_and_shared_experts():
    deepseek, maverick = lookup("deepseek-ai/DeepSeek-V3"), lookup("meta-llama/Llama-4-Maverick-17B-128E-Instruct")
    assert (deepseek.dense_layers, deepseek.moe_layers) == ((0, 1, 2), 58)
    assert {lin.name for lin in deepseek.layer_linears()} >= {"gate_proj", "up_proj", "down_proj", "kv_b_proj"}
    assert maverick.moe_layers == 24 and maverick.dense_layers == tuple(range(0, 48, 2))
    # the shared expert is a dense MLP of nn.Linear modules (LoRA and bitsandbytes see it), the routed ones are not
    shared = [lin for lin in maverick.decoder_linears if lin.in_features == 5120 and lin.out_features == 8192]
    assert sum(lin.count for lin in shared) == 2 * 24


def test_moe_experts_are_fused_parameters_not_linears():
    facts = lookup("Qwen/Qwen3-30B-A3B")
    names = {lin.name for lin in facts.layer_linears()}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert facts.expert_params == 48 * 128 * 3 * 2048 * 768
    assert facts.other_params > 48 * 128 * 2048  # the routers live in other_params


# ----------------------------------------------------------------------------- config.json


# Each layout's optional parts, switched on or off by its family's own config keys
LAYOUT_OPTIONS = {
    "gemma4_text": [
        dict(enable_moe_block=True, top_k_experts=2),
        dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    ],
    "deepseek_v3": [dict(first_k_dense_replace=1, num_hidden_layers=3), dict(q_lora_rank=None, n_shared_experts=2)],
    "llama4_text": [dict(interleave_moe_layer_step=2, num_hidden_layers=4), dict(attention_chunk_size=None)],
    "qwen3_moe": [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2)],
    "qwen3_next": [dict(mlp_only_layers=[1], num_hidden_layers=4)],
    "qwen3_5_text": [dict(num_hidden_layers=4)],  # three gated DeltaNet layers, then a full-attention one
    "qwen3_5_moe_text": [dict(num_hidden_layers=4)],
    "gpt_oss": [dict(attention_bias=False)],
}
# Gemma 4 without the per-layer input embeddings of its E2B/E4B releases, which ft does not count exactly
LAYOUT_BASE = {"gemma4_text": dict(hidden_size_per_layer_input=0)}
LAYOUT_CASES = [(t, {}) for t in sorted(EXACT_MODEL_TYPES)]
LAYOUT_CASES += [(t, extra) for t, options in LAYOUT_OPTIONS.items() for extra in options]


@pytest.mark.parametrize("model_type, extra", LAYOUT_CASES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_from_hf_config_is_exact_for_every_known_layout(model_type: str, extra: dict):
    cfg = dict(TINY, head_dim=16, num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    config = AutoConfig.for_model(model_type, **{**cfg, **LAYOUT_BASE.get(model_type, {}), **extra})
    facts = from_hf_config(config.to_dict(), "tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert facts.model_type == model_type and facts.counts_exact
    assert _fact_breakdown(facts) == _real_breakdown(model)
    assert _fact_linears(facts) == _real_linears(model.model.layers[0])
    merged = {(lin.name, lin.in_features, lin.out_features, lin.bias): lin.count for lin in facts.decoder_linears}
    assert merged == _all_real_linears(model)


@pytest.mark.parametrize(
    "facts", KNOWN_TO_TRANSFORMERS[:1] + [lookup("Qwen/Qwen3-30B-A3B"), lookup("microsoft/phi-2")], ids=lambda f: f.name
)
def test_to_hf_config_round_trips(facts: ModelFacts):
    config = AutoConfig.for_model(facts.model_type, **to_hf_config(facts))
    again = from_hf_config(config.to_dict(), facts.name)
    assert again == dataclasses.replace(facts, aliases=(), source="")


def test_to_hf_config_refuses_what_it_cannot_write():
    with pytest.raises(ValueError, match="kv_lora_rank.*use its config.json"):
        to_hf_config(lookup("deepseek-ai/DeepSeek-V3"))


@pytest.mark.parametrize("config_class", [LlamaConfig, Qwen2Config], ids=lambda c: c.__name__)
def test_resolve_local_folder(tmp_path, config_class):
    config = config_class(**TINY)
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    facts = resolve(str(tmp_path))
    assert facts.name == str(tmp_path)
    assert facts.num_params == _count(model.parameters())
    assert _fact_linears(facts) == _real_linears(model.model.layers[0])


def test_gemma3_multimodal_config_describes_the_text_tower():
    text = dict(TINY, head_dim=16)
    outer = Gemma3Config(text_config={**text, "model_type": "gemma3_text"}).to_dict()
    facts = from_hf_config(outer, "google/gemma-3-4b-it")
    assert facts.model_type == "gemma3_text" and facts.tie_word_embeddings
    # its vision tower (the default SigLIP: 12 layers of 768, ~86M with the projector) counted beside the text tower
    assert facts.num_params - facts.vision_params == _count(_meta_model("gemma3_text", text).parameters())
    assert 80e6 < facts.vision_params < 95e6


@pytest.mark.parametrize(
    "name, outer",
    [
        ("Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe"),
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4"),
        ("google/gemma-4-26B-A4B", "gemma4"),
    ],
)
def test_multimodal_releases_describe_their_text_tower(name: str, outer: str):
    """A local multimodal config.json (text_config nested, the head's tying outside) reads as the catalog's row."""
    text = catalog_config(name)
    del text["model_type"]
    config = {"model_type": outer, "tie_word_embeddings": text.pop("tie_word_embeddings"), "text_config": text}
    assert from_hf_config(config, name) == dataclasses.replace(lookup(name), aliases=(), source="")


def test_sparse_nested_text_config_takes_the_outer_model_type():
    cfg = {
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 96,
            "max_position_embeddings": 64,
        },
    }
    facts = from_hf_config(cfg, "x")
    assert (facts.model_type, facts.head_dim, facts.num_kv_heads) == ("gemma3_text", 16, 4)
    assert facts.tie_word_embeddings


def test_missing_head_dim_and_kv_heads_take_their_defaults():
    cfg = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "max_position_embeddings": 32,
        "head_dim": None,
    }
    facts = from_hf_config(cfg, "x")
    assert (facts.head_dim, facts.num_kv_heads, facts.tie_word_embeddings) == (8, 8, False)


def test_gpt_style_keys_and_unknown_model_type():
    cfg = {
        "model_type": "gpt2",
        "vocab_size": 100,
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "n_positions": 128,
        "n_inner": None,
    }
    facts = from_hf_config(cfg, "gpt2")
    assert (facts.hidden_size, facts.num_layers, facts.num_attention_heads) == (64, 3, 4)
    assert (facts.intermediate_size, facts.max_position_embeddings) == (256, 128)
    assert not facts.counts_exact


def test_missing_keys_are_all_named_at_once():
    with pytest.raises(ValueError) as err:
        from_hf_config({"model_type": "llama", "vocab_size": 10}, "broken")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        assert key in str(err.value)


def test_layouts_ft_cannot_count_exactly_are_flagged():
    moe = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    assert from_hf_config({"model_type": "qwen3_moe", **moe, "mlp_only_layers": [0]}, "x").counts_exact
    assert not from_hf_config({"model_type": "phi", **TINY, "qk_layernorm": True}, "x").counts_exact
    # Gemma 4's per-layer input embeddings (E2B, E4B; transformers' default) are not counted
    assert not from_hf_config({"model_type": "gemma4_text", **TINY}, "x").counts_exact
    assert from_hf_config({"model_type": "gemma4_text", **TINY, "hidden_size_per_layer_input": 0}, "x").counts_exact


def test_invalid_facts_report_every_problem():
    with pytest.raises(ValueError, match="hidden_size.*mlp must be|mlp must be.*hidden_size"):
        ModelFacts("bad", "llama", 10, 0, 10, 1, 1, 1, 1, False, 10, mlp="swiglu")
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelFacts("bad", "mixtral", 10, 8, 8, 1, 1, 1, 8, False, 10, num_experts=4)


def test_linear_params():
    assert Linear("fc1", 4, 3, count=2, bias=True).params == 2 * (12 + 3)


# ----------------------------------------------------------------------------- lookup, resolve


def test_lookup_by_alias_case_and_short_name():
    llama = lookup("meta-llama/Llama-3.1-8B")
    assert llama is not None and llama.name == "meta-llama/Llama-3.1-8B"
    for query in (
        "meta-llama/Llama-3.1-8B-Instruct",
        "META-LLAMA/llama-3.1-8b",
        "Llama-3.1-8B",
        "llama-3.1-8b",
        "Meta-Llama-3.1-8B-Instruct",
        " llama-3.1-8b ",
    ):
        assert lookup(query) is llama, query
    assert lookup("tiny").name == "ft-tiny"
    assert lookup("someone-else/Llama-3.1-8B") is None
    assert lookup("not-a-model") is None


def test_variants_keep_their_own_config_values():
    assert lookup("mistralai/Mistral-7B-Instruct-v0.3").vocab_size == 32768
    assert lookup("mistralai/Mistral-7B-Instruct-v0.2").vocab_size == 32000
    assert lookup("mistralai/Mixtral-8x22B-Instruct-v0.1").vocab_size == 32768
    assert lookup("Qwen/Qwen2.5-7B-Instruct").max_position_embeddings == 32768
    assert lookup("Qwen/Qwen2.5-7B").max_position_embeddings == 131072


def test_ft_tiny_entry():
    tiny = lookup("ft-tiny")
    assert (tiny.model_type, tiny.vocab_size, tiny.hidden_size, tiny.intermediate_size) == ("llama", 512, 128, 384)
    assert (tiny.num_layers, tiny.num_attention_heads, tiny.num_kv_heads, tiny.head_dim) == (4, 4, 2, 32)
    assert tiny.tie_word_embeddings and tiny.max_position_embeddings == 512


def test_suggest():
    assert "meta-llama/Llama-3.1-8B" in suggest("lama-3.1-8b")
    assert len(suggest("qwen3-8", n=2)) <= 2
    assert suggest("zzzzzzzzzzzzzzzzzz") == []


def test_resolve_prefers_the_catalog():
    assert resolve("Qwen2.5-0.5B-Instruct") is lookup("Qwen/Qwen2.5-0.5B")


def test_resolve_unknown_name_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(ModelNotFound) as err:
        resolve("qwen2.5-7b-instrct")
    assert time.monotonic() - start < 20
    message = str(err.value)
    assert "model.name 'qwen2.5-7b-instrct' is not in ft's catalog and not a local folder" in message
    assert "Did you mean:" in message and "Qwen/Qwen2.5-7B-Instruct" in message
    # offline: says so and how to plan without the hub (a folder with config.json), never the hub's raw error
    assert "offline" in message and "config.json" in message and "OSError" not in message
    with pytest.raises(ModelNotFound) as err:
        resolve("not-a-model")
    assert "the hub cannot be reached" in str(err.value)
    assert "No catalog name is close to it; catalog names look like" in str(err.value)
    assert err.value.reason  # what the hub said, kept for the curious


def test_model_not_found_pickles():
    err = pickle.loads(pickle.dumps(ModelNotFound("x", ("a", "b"), "offline")))
    assert (err.name, err.suggestions, err.reason) == ("x", ("a", "b"), "offline")
    assert "Did you mean: a, b?" in str(err)


def test_import_is_light():
    code = "import finetune.catalog, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    code = (
        "import sys; from finetune.catalog import resolve; resolve('Llama-3.1-8B'); "
        "assert 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
