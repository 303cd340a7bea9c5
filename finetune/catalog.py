"""Architecture facts of popular models, so that plans and memory estimates work offline.

`resolve(name)` gives the ModelFacts (finetune/catalog_facts.py) of a local folder's config.json, of a catalog entry
(finetune/catalog.yaml: published config.json values, each row with its source) or of the hub's config. A catalog row
is read exactly like a config.json (`from_hf_config`), by the per-model_type rules in finetune/catalog_data.py, and
the tests check each entry's counts against a model instantiated by transformers on the meta device.

This module imports neither torch nor transformers; `resolve` imports transformers lazily, only
when it must read a local folder or ask the hub.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import replace
from pathlib import Path

from finetune.catalog_data import (
    KEY_SPELLINGS,
    LAYOUTS,
    TEXT_MODEL_TYPES,
    TIED_BY_DEFAULT,
    catalog_rows,
    first,
    layout,
    row_config,
)
from finetune.catalog_facts import ModelFacts
from finetune.catalog_layers import Linear
from finetune.catalog_vision import folder_processor, projector_params, vision_params, vision_tower, with_processor

__all__ = [
    "CATALOG",
    "EXACT_MODEL_TYPES",
    "Linear",
    "ModelFacts",
    "ModelNotFound",
    "catalog_config",
    "from_hf_config",
    "lookup",
    "resolve",
    "suggest",
    "to_hf_config",
]

# model_type values whose layout ft knows exactly (tested against transformers on the meta device).
EXACT_MODEL_TYPES = frozenset(LAYOUTS)


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
    found = {field: first(cfg, keys) for field, keys in KEY_SPELLINGS.items()}
    missing = [" or ".join(KEY_SPELLINGS[f]) for f, value in found.items() if value is None]
    if missing:
        raise ValueError(f"config of {name!r} lacks " + ", ".join(missing))
    hidden, heads = found["hidden_size"], found["num_attention_heads"]
    inter = first(cfg, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * hidden
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
    core = _core_fields(text, name)
    switches = layout(model_type, {**text, "num_hidden_layers": core["num_layers"]})
    tie = text.get("tie_word_embeddings")
    tower = vision_tower(cfg)
    return ModelFacts(
        name=name,
        model_type=model_type,
        **{**core, **switches},
        tie_word_embeddings=model_type in TIED_BY_DEFAULT if tie is None else bool(tie),
        vision_params=vision_params(cfg, tower, core["hidden_size"]),
        projector_params=projector_params(cfg, tower, core["hidden_size"]),
        vision_model_type=str(cfg.get("model_type") or "") if isinstance(cfg.get("vision_config"), dict) else "",
        vision_tower=tower,
    )


# What to_hf_config cannot write: facts with any of these set need their family's own config keys.
_UNWRITTEN = ("layer_types", "kv_lora_rank", "linear_key_heads", "dense_layers", "shared_expert_size", "router_linear")
_UNWRITTEN += ("expert_bias", "attention_sinks", "query_gate", "global_head_dim", "moe_dense_mlp")


def to_hf_config(facts: ModelFacts) -> dict:
    """The config keys transformers needs to build this model: `AutoConfig.for_model(type, **d)`.

    Only for dense and plain MoE layouts; a catalog entry's own config is `catalog_config(name)`.
    """
    unwritten = [key for key in _UNWRITTEN if getattr(facts, key)]
    if unwritten:
        raise ValueError(f"to_hf_config cannot write {', '.join(unwritten)} of {facts.name!r}: use its config.json")
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


# --- the catalog ---
def _catalog() -> tuple[tuple[ModelFacts, dict], ...]:
    """Each row of finetune/catalog.yaml read as a config, with its name, aliases and source, and that config."""
    entries = []
    for row in catalog_rows():
        config = row_config(row)
        facts = from_hf_config(config, row["name"])
        entries.append((replace(facts, aliases=tuple(row.get("aliases", ())), source=row.get("source", "")), config))
    return tuple(entries)


_ENTRIES = _catalog()
CATALOG: tuple[ModelFacts, ...] = tuple(facts for facts, _ in _ENTRIES)
_CONFIGS = {facts.name: config for facts, config in _ENTRIES}
_INDEX = _build_index(CATALOG)


def catalog_config(name: str) -> dict:
    """The published config.json values a catalog entry is built from (its catalog.yaml row), by canonical name."""
    return dict(_CONFIGS[name])


# --- resolve: local folder -> catalog -> hub ---
UNREACHABLE = "unreachable: "  # how ModelNotFound's reason starts when the hub did not answer (finetune/hub.py)


class ModelNotFound(Exception):
    """No local folder, catalog entry or hub config describes the model name."""

    def __init__(self, name: str, suggestions: tuple[str, ...] = (), reason: str = "") -> None:
        super().__init__(name, tuple(suggestions), reason)
        self.name = name
        self.suggestions = tuple(suggestions)
        self.reason = reason

    def __str__(self) -> str:
        if self.offline:
            quiet = not self.reason.startswith(UNREACHABLE)  # offline mode, or transformers' own words
            tail = "." if quiet else "; or set HF_HUB_OFFLINE=1 (the local cache only), or HF_ENDPOINT to a mirror."
            why = "offline" if quiet else self.reason[len(UNREACHABLE) :]
            text = (
                f"model.name {self.name!r} is not in ft's catalog and not a local folder, and the hub cannot be "
                f"reached from here ({why}), so ft cannot read its shape. Give model.name a local folder with its "
                "config.json (enough for ft plan; training also needs its *.safetensors), e.g. fetched on a machine "
                f"with access by `hf download {self.name} --local-dir models/{self.name.split('/')[-1]}`, or use a "
                f"catalog name of the same architecture{tail}"
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
        unreachable = any(
            s in self.reason.lower() for s in ("couldn't connect", "offline", "connection", "resolve", UNREACHABLE)
        )
        return quiet or unreachable


def _local_config(folder: Path, trust_remote_code: bool) -> dict:
    """A local config, with transformers' defaults filled in where transformers knows the type."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
        return config.to_dict()
    except (ImportError, ValueError, KeyError, OSError):
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))


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
        facts = from_hf_config(_local_config(folder, trust_remote_code), name)
        processor = any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json"))
        tower = facts.vision_tower
        if tower is not None:  # the folder's processor sizes its images, where it says how
            tower = with_processor(tower, folder_processor(folder), "the model's preprocessor_config.json")
        return replace(facts, image_processor=facts.vision_params > 0 and processor, vision_tower=tower)
    found = lookup(name)
    if found is not None:
        return found
    from finetune import hub

    why = hub.unreachable(name, revision)  # one request, no retries (finetune/hub.py)
    if why and not hub.cached(name, "config.json", revision):  # fail now, without importing transformers
        raise ModelNotFound(name, tuple(suggest(name)), f"{UNREACHABLE}{hub.endpoint()}: {why}")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            name, revision=revision, trust_remote_code=trust_remote_code, local_files_only=bool(why)
        )
        cfg = config.to_dict()
    except Exception as exc:  # noqa: BLE001 - every way the hub fails means "not found here"
        raise ModelNotFound(name, tuple(suggest(name)), _first_line(exc)) from exc
    facts = from_hf_config(cfg, name)
    return replace(facts, image_processor=facts.vision_params > 0)  # a hub model ships its processor files
