"""Which model families ft writes as GGUF, and why the others are refused.

The table is data (gguf_families.yaml): per transformers model_type, llama.cpp's architecture and the few ways its
tensors or hyper-parameters differ from transformers' (query/key row order for rotary embeddings, Gemma's norm
offset, sliding windows, soft-capping, the attention scale llama.cpp fixes). `family(config)` returns the row for a
model's config, or an FtError naming what llama.cpp (or ft's writer) cannot take and what to do instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

from finetune.errors import FtError

ROPE_TYPES = ("default", "linear", "llama3")  # rotary scalings written; others (yarn, longrope, dynamic) refused


@dataclass(frozen=True)
class Family:
    """One row of gguf_families.yaml."""

    model_type: str
    arch: str
    rope_pairs: bool
    norm_offset: float
    sliding: str
    softcap: bool
    wide_scale: int


@dataclass(frozen=True)
class PreTokenizer:
    """llama.cpp's name for a pre-tokenizer (tokenizer.ggml.pre), and the steps of tokenizer.json it stands for."""

    name: str
    steps: tuple[str, ...]


@cache
def _table() -> dict:
    import yaml

    text = resources.files("finetune.export").joinpath("gguf_families.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def families() -> dict[str, Family]:
    return {row["model_type"]: Family(**row) for row in _table()["families"]}


def pre_tokenizers() -> list[PreTokenizer]:
    return [PreTokenizer(row["name"], tuple(row["steps"])) for row in _table()["pre_tokenizers"]]


def _refuse(what: str, why: str, fix: str) -> FtError:
    return FtError(f"cannot export {what} as GGUF: {why}\n    fix: {fix}")


def family(config, what: str) -> Family:
    """The row for a transformers config (of the merged model `what`); FtError for what ft does not export."""
    architectures = list(getattr(config, "architectures", None) or [])
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise _refuse(
            what,
            f"it is a reward model ({architectures[0]}): it scores text with a head llama.cpp does not run as a "
            "language model.",
            "export the policy trained with it; the reward model itself stays a transformers model (ft eval, GRPO "
            "rewards)",
        )
    if getattr(config, "vision_config", None) is not None:
        raise _refuse(
            what,
            f"it is a vision-language model ({config.model_type}); llama.cpp runs its image tower from a separate "
            "projector file that ft does not write.",
            "use llama.cpp's own converter (convert_hf_to_gguf.py, with --mmproj for the projector) on the folder "
            "ft merge-lora writes",
        )
    experts = [k for k in ("num_local_experts", "num_experts", "n_routed_experts") if getattr(config, k, None)]
    if experts:
        raise _refuse(
            what,
            f"it is a mixture-of-experts model ({config.model_type}, {experts[0]}={getattr(config, experts[0])}); "
            "ft writes dense families only.",
            "use llama.cpp's own converter (convert_hf_to_gguf.py) on the folder ft merge-lora writes",
        )
    known = families()
    row = known.get(config.model_type)
    if row is None:
        raise _refuse(
            what,
            f"ft does not write the model family {config.model_type!r} (it writes {', '.join(sorted(known))}).",
            "use llama.cpp's own converter (convert_hf_to_gguf.py) on the folder ft merge-lora writes, if llama.cpp "
            "supports the family",
        )
    _check_rope(config, what)
    return row


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def query_factor(row: Family, config) -> float:
    """What the queries are multiplied by so that llama.cpp's fixed attention scale gives transformers' scores:
    sqrt(llama.cpp's divisor / transformers' query_pre_attn_scalar); 1 where the config has no such scalar."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if not scalar:
        return 1.0
    theirs = head_dim(config)
    if row.wide_scale and config.num_hidden_layers == row.wide_scale:
        theirs = config.hidden_size / config.num_attention_heads
    return math.sqrt(theirs / scalar)


def rope(config) -> dict:
    """The rotary settings of a config (transformers 5: rope_parameters; earlier: rope_theta and rope_scaling), of its
    full-attention layers where it has several kinds."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:
        params = dict(params["full_attention"] or {})
    scaling = getattr(config, "rope_scaling", None)
    if not params.get("rope_type") and isinstance(scaling, dict):
        params.update(scaling)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def sliding_rope_theta(config) -> float | None:
    """The rotary base of a model's sliding-window layers where it differs from the others (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or {}
    sliding = params.get("sliding_attention") if isinstance(params, dict) else None
    return (sliding or {}).get("rope_theta") or getattr(config, "rope_local_base_freq", None)


def _check_rope(config, what: str) -> None:
    kind = rope(config)["rope_type"]
    if kind not in ROPE_TYPES:
        raise _refuse(
            what,
            f"its rotary embeddings use the {kind!r} scaling, which ft does not write (it writes "
            f"{', '.join(ROPE_TYPES)}).",
            "use llama.cpp's own converter (convert_hf_to_gguf.py) on the folder ft merge-lora writes",
        )
