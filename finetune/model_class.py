"""What the model class transformers builds for a config declares about attention and packing, read without weights.

`ModelClass` holds the class's own declarations (`_supports_sdpa`, `_supports_flex_attn`, `_supports_flash_attn` and
`_compatible_flash_implementations`), what its modules are (attention sinks: a `sinks` parameter, which transformers
passes to the attention function as `s_aux`; state-space or linear-attention mixers) and what the config makes of its
layers (layer types, sliding window, attention chunk, attention dropout). The planner decides the attention kernel and
how packed rows keep samples apart from it (finetune/plan/attention.py).

Reading a class imports its modeling module and builds the model on the meta device (no memory, no weights). The
classes of the families ft knows are read once into the data file finetune/model_classes.json, one row of named facts
per model type (`python -m finetune.model_class` rewrites it; tests/test_families.py checks it against the installed
transformers), so that planning a catalog model imports neither torch nor transformers; a local folder's config is
read with transformers' AutoConfig, as `catalog.resolve` reads it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

TABLE_FILE = "model_classes.json"  # package data of finetune, next to catalog.yaml
ABOUT = (
    "The attention facts of the model classes ft knows, one row per model type (finetune/model_class.py `table_row`: "
    "the class AutoModelForCausalLM builds for the config class's defaults), read from the installed transformers by "
    "`python -m finetune.model_class`; do not edit by hand."
)
CLASSES: dict[str, dict] = json.loads(resources.files("finetune").joinpath(TABLE_FILE).read_text(encoding="utf-8"))[
    "classes"
]

ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
# Per mixer kind: the packages (import name, what pip installs) whose kernels keep packed samples apart, as the model's
# modeling code calls them (transformers integrations/hub_kernels.py `use_kernel_func_from_hub_with_fallback`: the
# PyTorch fallbacks refuse `cu_seqlens`/`seq_idx`, or ignore sample boundaries when given none). CUDA-only packages.
MIXER_KERNELS = {
    "gated_delta_net": (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d")),
    "mamba": (("mamba_ssm", "mamba-ssm"), ("causal_conv1d", "causal-conv1d")),
}


@dataclass(frozen=True)
class ModelClass:
    """The attention facts of one model class and config."""

    model_type: str  # the config's (a multimodal wrapper's own, e.g. gemma3)
    name: str  # the class AutoModelForCausalLM builds, e.g. GptOssForCausalLM
    sdpa: bool = True  # _supports_sdpa: torch SDPA (and ft's sdpa_varlen, which calls it per sample)
    flex: bool = True  # _supports_flex_attn
    flash: bool = True  # flash_attention_2 loads: _supports_flash_attn and, where listed, a compatible implementation
    sinks: bool = False  # attention sinks (gpt-oss): an extra softmax column SDPA cannot express
    mixers: tuple[str, ...] = ()  # state-space or linear-attention mixer kinds: gated_delta_net, mamba
    layer_types: tuple[str, ...] = ("full_attention",)  # the distinct kinds of layers the config has
    sliding_window: int | None = None  # tokens a sliding_attention layer looks back over
    chunk_size: int | None = None  # tokens of a chunked_attention layer's chunks (llama4)
    attention_dropout: float = 0.0
    declared: bool = True  # False: transformers does not know the model type; a llama-like class is assumed
    kernels_installed: tuple[str, ...] = field(default=(), compare=False)  # of MIXER_KERNELS' packages, importable

    @property
    def attention_kinds(self) -> tuple[str, ...]:
        return tuple(t for t in self.layer_types if t in ATTENTION_LAYERS)

    def missing_kernels(self) -> tuple[str, ...]:
        """What pip must install so that every mixer keeps packed samples apart (empty: nothing)."""
        wanted = dict.fromkeys(pip for kind in self.mixers for _, pip in MIXER_KERNELS.get(kind, ()))
        have = set(self.kernels_installed)
        return tuple(pip for pip in wanted if pip not in have)

    def to_row(self) -> dict:
        """The class-level facts as a row of the table (model_classes.json, CLASSES)."""
        keys = ("name", "sdpa", "flex", "flash", "sinks", "mixers", "layer_types", "sliding_window", "chunk_size")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(self, k)) for k in keys)}


def installed_kernels() -> tuple[str, ...]:
    """The packages of MIXER_KERNELS this environment can import (pip names)."""
    found = {pip for pairs in MIXER_KERNELS.values() for module, pip in pairs if importlib.util.find_spec(module)}
    return tuple(sorted(found))


def from_row(model_type: str, row: dict) -> ModelClass:
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in row.items()}
    return ModelClass(model_type=model_type, **values, kernels_installed=installed_kernels())


def assumed(model_type: str) -> ModelClass:
    """A model type transformers does not declare (remote code, a misspelled config): a llama-like class."""
    return ModelClass(model_type, "unknown", declared=False, kernels_installed=installed_kernels())


@functools.lru_cache(maxsize=64)
def for_facts(facts) -> ModelClass:
    """The class of a model as ft resolved it (catalog.ModelFacts): its local folder's config where it has one, else
    the table's row for its model type (the config class's defaults), else `assumed`. Cached: the planner's search
    asks for it in every setup it estimates."""
    folder = Path(facts.name).expanduser()
    if (folder / "config.json").is_file():
        return for_folder(str(folder.resolve()))
    row = CLASSES.get(facts.model_type)
    return from_row(facts.model_type, row) if row else assumed(facts.model_type)


@functools.cache
def for_folder(folder: str) -> ModelClass:
    """The class of a local model folder, with its config's layers: the table's class facts for a known type, read from
    transformers for any other."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError):  # a type transformers does not know
        import json

        return assumed(str(json.loads((Path(folder) / "config.json").read_text()).get("model_type", "unknown")))
    row = CLASSES.get(config.model_type)
    if not row:
        try:
            return read(config)
        except (ValueError, KeyError, TypeError, ImportError):  # no causal-LM class for it: what the loader will say
            return assumed(config.model_type)
    layers = layer_facts(config)
    base = from_row(config.model_type, row)
    mixers = base.mixers if "linear_attention" in layers["layer_types"] else ()  # the table's: its class's default
    return replace(base, mixers=mixers, **layers)


def layer_facts(config) -> dict:
    """What the config makes of its layers: layer types, sliding window, attention chunk, attention dropout."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    types = getattr(text, "layer_types", None) or ["sliding_attention" if window else "full_attention"]
    chunk = getattr(text, "attention_chunk_size", None)
    return {
        "layer_types": tuple(dict.fromkeys(types)),
        "sliding_window": window if "sliding_attention" in types else None,
        "chunk_size": chunk if "chunked_attention" in types else None,
        "attention_dropout": float(getattr(text, "attention_dropout", 0.0) or 0.0),
    }


def read(config) -> ModelClass:
    """Read the class AutoModelForCausalLM builds for `config` (a transformers config), building it on the meta
    device: its declarations, its modules (sinks, mixers) and the config's layers."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    cls = type(model)
    compatible = getattr(cls, "_compatible_flash_implementations", None)
    return ModelClass(
        model_type=config.model_type,
        name=cls.__name__,
        sdpa=bool(cls._supports_sdpa),
        flex=bool(cls._supports_flex_attn),
        flash=bool(cls._supports_flash_attn) and (compatible is None or "flash_attention_2" in compatible),
        sinks=any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()),
        mixers=mixer_kinds(model),
        kernels_installed=installed_kernels(),
        **layer_facts(config),
    )


def mixer_kinds(model) -> tuple[str, ...]:
    """The state-space and linear-attention mixers among the model's modules, by their transformers class names."""
    kinds = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("GatedDeltaNet"):
            kinds.append("gated_delta_net")
        elif "Mamba" in name and name.endswith(("MambaLayer", "Mixer")):
            kinds.append("mamba")
    return tuple(dict.fromkeys(kinds))


# ---------------------------------------------------------------- the table (model_classes.json)
TABLE_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "gpt_oss",
    "deepseek_v3",
    "llama4",
    "llama4_text",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gemma4",
    "gemma4_text",
    "glm4_moe",
    "olmo2",
    "olmo3",
    "smollm3",
    "phi",
    "phi3",
    "stablelm",
    "granitemoehybrid",
)


def table_row(model_type: str) -> dict:
    """The row `python -m finetune.model_class` writes for a model type: its class read with the config class's
    defaults."""
    from transformers import AutoConfig

    return read(AutoConfig.for_model(model_type)).to_row()


def write_table(path: Path) -> None:
    """Write the table of every TABLE_TYPES row, read from the installed transformers, to `path` as JSON."""
    rows = {t: table_row(t) for t in TABLE_TYPES}
    path.write_text(json.dumps({"about": ABOUT, "classes": rows}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    write_table(Path(__file__).with_name(TABLE_FILE))
