"""Loading tokenizers (and, with the training issue, models) per the config and the Plan."""

from __future__ import annotations

from pathlib import Path

from finetune.config.schema import ModelSection
from finetune.errors import FtError

BUILT_IN = ("ft-tiny", "tiny")


def load_tokenizer(model: ModelSection):
    """The tokenizer named by model.tokenizer, else the model's own; ft-tiny's is built offline."""
    name = model.tokenizer or model.name
    key = "model.tokenizer" if model.tokenizer else "model.name"
    if name.lower() in BUILT_IN and not Path(name).exists():
        from finetune.tiny import ensure_model

        name = str(ensure_model())
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, revision=model.revision, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FtError(f"{key}: cannot load a tokenizer from {name!r}: {first}. Use a local folder with tokenizer files, a hub id (online), or ft-tiny") from None


def add_special_tokens(tokenizer, tokens: list[str]) -> list[str]:
    """Add the tokens that are not yet single tokens; return those added (the model's embeddings must grow)."""
    vocab = tokenizer.get_vocab()
    new = [t for t in dict.fromkeys(tokens) if t not in vocab]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    return new


def model_path(model: ModelSection) -> str:
    """Where the weights come from: ft-tiny is built once into ft's cache; anything else as written."""
    if model.name.lower() in BUILT_IN and not Path(model.name).exists():
        from finetune.tiny import ensure_model

        return str(ensure_model())
    p = Path(model.name).expanduser()
    if (p.is_absolute() or model.name.startswith(".")) and not p.exists():
        raise FtError(f"model.name: the folder {model.name} does not exist; point it at a folder with config.json and safetensors weights, or use a hub id")
    return str(p) if p.exists() else model.name


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def runtime_attention(model: ModelSection, planned: str) -> str:
    """The attention kernel to run: the plan's, upgraded to flash-attention 2 when ft chose it (model.attn_implementation
    auto), flash-attn is installed and the GPU supports it (Ampere or newer). Packed batches work with either."""
    import importlib.util

    import torch

    if model.attn_implementation != "auto" or planned not in ("sdpa", "sdpa_varlen"):
        return planned
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8 and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return planned


def load_model(model: ModelSection, plan, tokenizer=None, attn_implementation: str | None = None):
    """The model as the plan says: dtype, attention kernel, 4/8-bit base, resized embeddings, checkpointing."""
    from transformers import AutoModelForCausalLM

    attn = attn_implementation or plan.attn_implementation
    kwargs = {"attn_implementation": attn, "use_safetensors": True, "trust_remote_code": model.trust_remote_code}
    if plan.adapter == "full":
        kwargs["dtype"] = torch_dtype("fp32")  # fp32 master weights; autocast computes in plan.precision
    else:
        kwargs["dtype"] = torch_dtype(model.dtype if model.dtype != "auto" else plan.precision)
    if plan.quantization in ("nf4", "int8"):
        kwargs["quantization_config"] = quantization_config(plan)
    import torch

    if torch.cuda.is_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    if attn == "sdpa_varlen":
        from finetune.attention import register

        register()
    path = model_path(model)
    try:
        net = AutoModelForCausalLM.from_pretrained(path, revision=model.revision, **kwargs)
    except OSError as e:
        raise FtError(f"model.name: cannot load {model.name!r}: {str(e).splitlines()[0]}") from None
    if tokenizer is not None and len(tokenizer) > net.get_input_embeddings().weight.shape[0]:
        net.resize_token_embeddings(len(tokenizer))
    net.config.use_cache = False
    if plan.gradient_checkpointing:
        enable = getattr(net, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return net


def quantization_config(plan):
    from transformers import BitsAndBytesConfig

    compute = torch_dtype(plan.precision)
    if plan.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    kwargs = {"bnb_4bit_quant_storage": compute} if plan.backend == "fsdp" or plan.sharding == "zero3" else {}  # sharding flattens one dtype
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute, **kwargs)
