"""Architecture facts of popular models, so that plans and memory estimates work offline.

A `ModelFacts` holds what a model's config.json says about its shape, plus the few switches that
decide which parameters transformers creates (bias terms, norm kind, fused projections, experts).
Every count is built from those facts, never from a rounded marketing size, and the tests check
each catalog entry against a model instantiated by transformers on the meta device.

This module imports neither torch nor transformers; `resolve` imports transformers lazily, only
when it must read a local folder or ask the hub.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.catalog_data import ENTRIES, KEY_SPELLINGS, LAYOUTS, TEXT_MODEL_TYPES, TIED_BY_DEFAULT, layout

MLP_KINDS = ("gated", "plain")
NORM_KINDS = ("rms", "layer")

# model_type values whose layout ft knows exactly (tested against transformers on the meta device).
EXACT_MODEL_TYPES = frozenset(LAYOUTS)


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
class ModelFacts:
    """The architecture of one causal language model, as transformers builds it."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    mlp: str = "gated"  # "gated": gate/up/down projections; "plain": fc1/fc2
    norm: str = "rms"  # "rms": weight only; "layer": weight and bias
    norms_per_layer: int = 2  # hidden-size norms in one decoder layer (gemma2/3 have 4, phi 1)
    qk_norm: bool = False  # per-head RMS norm on queries and keys (qwen3, gemma3)
    attention_bias: bool = False  # bias on the q, k and v projections
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    lm_head_bias: bool = False
    fused_qkv: bool = False  # one qkv_proj instead of q_proj/k_proj/v_proj (phi3)
    fused_gate_up: bool = False  # one gate_up_proj instead of gate_proj/up_proj (phi3)
    num_experts: int = 0  # MoE experts per layer; 0 for a dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # hidden size of one expert's MLP
    counts_exact: bool = True  # False where the layout was guessed (an unknown model_type)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = _shape_problems(self)
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

    def layer_linears(self) -> tuple[Linear, ...]:
        """The nn.Linear modules of ONE decoder layer: what LoRA "all-linear" and bitsandbytes see.

        MoE experts are not listed: transformers 5 stores them as fused 3-D parameters, and the
        router is a plain parameter too (see `expert_params` and `other_params`).
        """
        return self._attention_linears() + self._mlp_linears()

    def _attention_linears(self) -> tuple[Linear, ...]:
        h, bias = self.hidden_size, self.attention_bias
        if self.fused_qkv:
            qkv = (Linear("qkv_proj", h, self.q_dim + 2 * self.kv_dim, bias=bias),)
        else:
            qkv = (
                Linear("q_proj", h, self.q_dim, bias=bias),
                Linear("k_proj", h, self.kv_dim, bias=bias),
                Linear("v_proj", h, self.kv_dim, bias=bias),
            )
        out_name = "dense" if self.model_type == "phi" else "o_proj"
        return qkv + (Linear(out_name, self.q_dim, h, bias=self.o_bias),)

    def _mlp_linears(self) -> tuple[Linear, ...]:
        h, inter, bias = self.hidden_size, self.intermediate_size, self.mlp_bias
        if self.is_moe:
            return ()
        if self.mlp == "plain":
            return (Linear("fc1", h, inter, bias=bias), Linear("fc2", inter, h, bias=bias))
        if self.fused_gate_up:
            gate_up = (Linear("gate_up_proj", h, 2 * inter, bias=bias),)
        else:
            gate_up = (Linear("gate_proj", h, inter, bias=bias), Linear("up_proj", h, inter, bias=bias))
        return gate_up + (Linear("down_proj", inter, h, bias=bias),)

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
        """All decoder layers' nn.Linear weights and biases (what bitsandbytes quantizes)."""
        return self.num_layers * sum(linear.params for linear in self.layer_linears())

    @property
    def expert_params(self) -> int:
        """All layers' MoE expert weights (fused 3-D parameters in transformers 5); 0 if dense."""
        return self.num_layers * self._experts_per_layer()

    def _experts_per_layer(self) -> int:
        # gate and up (fused as gate_up_proj) plus down, for every expert
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def _norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm == "layer" else 1)  # LayerNorm adds a bias

    def _norms_per_layer(self) -> int:
        qk = 2 * self.head_dim if self.qk_norm else 0
        return self.norms_per_layer * self._norm_params() + qk

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (the unit FSDP gathers)."""
        linears = sum(linear.params for linear in self.layer_linears())
        router = self.num_experts * self.hidden_size
        return linears + self._experts_per_layer() + router + self._norms_per_layer()

    @property
    def num_params(self) -> int:
        """Total parameters, as transformers instantiates the model (tied weights counted once)."""
        layers = self.num_layers * self.layer_params
        return self.embedding_params + self.lm_head_params + layers + self._norm_params()

    @property
    def other_params(self) -> int:
        """Norms, routers and everything else that is not embedding, head, linear or expert."""
        counted = self.embedding_params + self.lm_head_params + self.linear_params + self.expert_params
        return self.num_params - counted


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
    if isinstance(facts.aliases, (str, list)):
        problems.append("aliases must be a tuple of names")
    return problems


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


CATALOG: tuple[ModelFacts, ...] = tuple(ModelFacts(**entry) for entry in ENTRIES)


def _short(name: str) -> str:
    """The part after "org/", lower-cased."""
    return name.rsplit("/", 1)[-1].lower()


def _build_index(catalog: tuple[ModelFacts, ...]) -> dict[str, ModelFacts]:
    """Lower-cased name, alias and org-less short name of every entry -> the entry."""
    index: dict[str, ModelFacts] = {}
    for facts in catalog:
        for key in (facts.name, *facts.aliases):
            for variant in {key.lower(), _short(key)}:
                owner = index.setdefault(variant, facts)
                if owner is not facts:
                    raise ValueError(f"catalog key {variant!r} names both {owner.name!r} and {facts.name!r}")
    return index


_INDEX = _build_index(CATALOG)


def lookup(name: str) -> ModelFacts | None:
    """The catalog entry for a canonical name or alias, case-insensitive, with or without "org/".

    A name under another org ("someone/Llama-3.1-8B") is a different repository and is not matched.
    """
    return _INDEX.get(name.strip().lower())


def suggest(name: str, n: int = 3) -> list[str]:
    """The canonical names of the catalog entries closest to `name`, best first."""
    key = name.strip().lower()
    matches = difflib.get_close_matches(key, list(_INDEX), n=4 * n, cutoff=0.5)
    matches += difflib.get_close_matches(_short(key), list(_INDEX), n=4 * n, cutoff=0.5)
    ranked = sorted(matches, key=lambda m: _closeness(key, m), reverse=True)
    names: list[str] = []
    for match in ranked:
        if _INDEX[match].name not in names:
            names.append(_INDEX[match].name)
    return names[:n]


def _closeness(query: str, key: str) -> float:
    return difflib.SequenceMatcher(None, _short(query), _short(key)).ratio()


# --- config.json -> ModelFacts ---
def _first(cfg: dict, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _text_config(cfg: dict) -> tuple[dict, str]:
    """The language model's part of a config, and its model_type."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg, str(cfg.get("model_type") or "unknown")
    outer = str(cfg.get("model_type") or "")
    model_type = text.get("model_type") or TEXT_MODEL_TYPES.get(outer, outer) or "unknown"
    merged = {"tie_word_embeddings": cfg.get("tie_word_embeddings"), **text}
    return merged, str(model_type)


def _core_fields(cfg: dict, name: str) -> dict:
    """The shape fields every model has; ValueError naming all missing keys at once."""
    found = {field: _first(cfg, keys) for field, keys in KEY_SPELLINGS.items()}
    missing = [" or ".join(KEY_SPELLINGS[f]) for f, value in found.items() if value is None]
    if missing:
        raise ValueError(f"config of {name!r} lacks " + ", ".join(missing))
    hidden, heads = found["hidden_size"], found["num_attention_heads"]
    inter = _first(cfg, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * hidden
    return {
        **found,
        "intermediate_size": inter,
        "num_kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or (hidden // heads if heads else 0),
    }


def from_hf_config(cfg: dict, name: str) -> ModelFacts:
    """ModelFacts from a config.json dict (or a transformers config's `to_dict()`).

    Handles multimodal configs with a nested "text_config" (the text tower is described),
    a missing head_dim (hidden/heads), a missing num_key_value_heads (= heads) and GPT-style key
    names. An unknown model_type is read as a llama-like layout with `counts_exact=False`.
    """
    text, model_type = _text_config(cfg)
    switches = layout(model_type, text)
    tie = text.get("tie_word_embeddings")
    return ModelFacts(
        name=name,
        model_type=model_type,
        **_core_fields(text, name),
        tie_word_embeddings=model_type in TIED_BY_DEFAULT if tie is None else bool(tie),
        **switches,
    )


def to_hf_config(facts: ModelFacts) -> dict:
    """The config keys transformers needs to build this model: `AutoConfig.for_model(type, **d)`."""
    cfg = {
        "vocab_size": facts.vocab_size,
        "hidden_size": facts.hidden_size,
        "intermediate_size": facts.intermediate_size,
        "num_hidden_layers": facts.num_layers,
        "num_attention_heads": facts.num_attention_heads,
        "num_key_value_heads": facts.num_kv_heads,
        "head_dim": facts.head_dim,
        "tie_word_embeddings": facts.tie_word_embeddings,
        "max_position_embeddings": facts.max_position_embeddings,
        "attention_bias": facts.attention_bias,
        "mlp_bias": facts.mlp_bias,
    }
    if facts.model_type == "stablelm":
        cfg.update(use_qkv_bias=facts.attention_bias, use_parallel_residual=facts.norms_per_layer == 1)
    if facts.is_moe:
        cfg.update(
            num_local_experts=facts.num_experts,
            num_experts=facts.num_experts,
            num_experts_per_tok=facts.experts_per_token,
            moe_intermediate_size=facts.moe_intermediate_size,
        )
    return cfg


# --- resolve: local folder -> catalog -> hub ---
class ModelNotFound(Exception):
    """No local folder, catalog entry or hub config describes the model name."""

    def __init__(self, name: str, suggestions: tuple[str, ...] = (), reason: str = "") -> None:
        super().__init__(name, tuple(suggestions), reason)
        self.name = name
        self.suggestions = tuple(suggestions)
        self.reason = reason

    def __str__(self) -> str:
        if self.offline:
            text = (
                f"model.name {self.name!r} is not in ft's catalog and not a local folder, and the hub cannot be "
                "reached from here (offline), so ft cannot read its shape. Give model.name a local folder with its "
                "config.json (enough for ft plan; training also needs its *.safetensors), e.g. fetched on a machine "
                f"with access by `huggingface-cli download {self.name} --local-dir "
                f"models/{self.name.split('/')[-1]}`, or use a catalog name of the same architecture."
            )
        else:
            text = (
                f"model.name {self.name!r} is not a local folder with config.json, not in ft's "
                "catalog, and could not be fetched from the hub."
            )
        if self.suggestions:
            text += " Did you mean: " + ", ".join(self.suggestions) + "?"
        else:
            text += (
                " No catalog name is close to it; catalog names look like "
                "'meta-llama/Llama-3.1-8B', 'Qwen/Qwen2.5-7B-Instruct' or 'ft-tiny'."
            )
        if self.reason and not self.offline:
            text += f" (hub: {self.reason})"
        return text

    @property
    def offline(self) -> bool:
        """The hub was not asked or not reachable (HF_HUB_OFFLINE, no network), as opposed to answering no."""
        import os

        quiet = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        unreachable = any(s in self.reason.lower() for s in ("couldn't connect", "offline", "connection", "resolve"))
        return quiet or unreachable


def _local_config(folder: Path, trust_remote_code: bool) -> dict:
    """A local config, with transformers' defaults filled in where transformers knows the type."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        return config.to_dict()
    except (ImportError, ValueError, KeyError, OSError):
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def _hub_config(name: str, revision: str, trust_remote_code: bool) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
    return config.to_dict()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def resolve(name: str, revision: str = "main", trust_remote_code: bool = False) -> ModelFacts:
    """Facts for `name`: a local folder with config.json, else the catalog, else the hub's config.

    Raises ModelNotFound (with suggestions) when none of the three knows the name, and ValueError
    when a config was found but lacks the keys that define the model's shape.
    """
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        return from_hf_config(_local_config(folder, trust_remote_code), name)
    found = lookup(name)
    if found is not None:
        return found
    try:
        cfg = _hub_config(name, revision, trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - every way the hub fails means "not found here"
        raise ModelNotFound(name, tuple(suggest(name)), _first_line(exc)) from exc
    return from_hf_config(cfg, name)
