"""Loading what a source names: a base model, its tokenizer, and an adapter checked against its base, attached
and merged.

The adapter's shapes are read from its safetensors header and compared with the base's modules before
peft sees them, so a mismatch is explained (which setting chose the base, which sizes differ) rather
than dumped as a traceback; peft's own errors become FtErrors too.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from finetune.errors import FtError

if TYPE_CHECKING:
    from finetune.artifacts.sources import ModelSource

DTYPES = ("auto", "bf16", "fp16", "fp32")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # a vision-language model's processor


def dtypes() -> dict:
    """The torch dtype each DTYPES name other than auto stands for."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def final_dtype(output, plan):
    """The torch dtype a fully fine-tuned model is saved in (output.save_dtype; auto: the plan's compute precision, so
    mixed-precision training writes its fp32 master weights rounded once); None for an adapter (saved as trained)."""
    if plan.adapter != "full":
        return None
    return dtypes()[plan.precision if output.save_dtype == "auto" else output.save_dtype]


def saved_tensor(t, dtype=None, copy: bool = False):
    """A whole tensor as final/ stores it, in host memory: floating values cast to `dtype` where they are (on a GPU:
    one tensor's cast at a time, then its copy to the host, so no second whole model in another dtype ever exists),
    other tensors as they are; `copy`: in storage of its own even where nothing changes (a gathered parameter)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype).cpu()
    return t.to("cpu", copy=copy)


def saved_state(model, dtype) -> dict:
    """The state dict of a whole (unsharded) model as final/ stores it (`saved_tensor`); tied names share one tensor,
    which transformers' save_pretrained writes once."""
    done, out = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in done:
            done[id(t)] = saved_tensor(t, dtype)
        out[name] = done[id(t)]
    return out


def record_dtype(folder: Path, dtype) -> None:
    """Write the dtype of the saved weights into folder/config.json (save_pretrained records the model's own)."""
    import json

    from finetune.files import atomic_write_text

    config = folder / "config.json"
    data = json.loads(config.read_text())
    data["dtype"] = str(dtype).removeprefix("torch.")
    atomic_write_text(config, json.dumps(data, indent=2, sort_keys=True) + "\n")


def first_line(e: BaseException) -> str:
    """The line of an exception worth showing: a size mismatch when torch lists them, else the first line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    sizes = [line for line in lines if line.startswith("size mismatch")]
    return (
        (sizes[0] + (f" (and {len(sizes) - 1} more)" if len(sizes) > 1 else ""))
        if sizes
        else (lines[0] if lines else type(e).__name__)
    )


# ---------------------------------------------------------------- tokenizer
def find_tokenizer(dirs: list[Path], base: str, trust_remote_code: bool):
    """(tokenizer, where it came from): the first folder with tokenizer files, else the base's, else (None, "")."""
    from transformers import AutoTokenizer

    for where in [*(str(d) for d in dirs if any((d / f).is_file() for f in TOKENIZER_FILES)), base]:
        try:
            return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code), where
        except (OSError, ValueError, TypeError):
            continue
    return None, ""


def find_processor(dirs: list[Path], base: str, trust_remote_code: bool):
    """A vision-language model's processor (image processor and tokenizer): from the first folder that has one, else
    the base's; None when none has (a text model)."""
    from transformers import AutoProcessor

    for where in [*(str(d) for d in dirs if any((d / f).is_file() for f in PROCESSOR_FILES)), base]:
        try:
            processor = AutoProcessor.from_pretrained(where, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError, AttributeError, ImportError):
            continue
        if hasattr(processor, "image_processor") and hasattr(processor, "tokenizer"):
            return processor
    return None


def load_tokenizer(src: ModelSource):
    """The run's or adapter's saved tokenizer, else the model's; a pad token is set (EOS) when missing."""
    tokenizer, _ = find_tokenizer([Path(d) for d in src.tokenizer_dirs], src.model, src.trust_remote_code)
    if tokenizer is None:
        raise FtError(
            f"no tokenizer found for {src.describe()}.\n    fix: copy the tokenizer files (tokenizer.json, "
            "tokenizer_config.json) into the model folder"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---------------------------------------------------------------- models
def load_base(base: str, dtype, trust_remote_code: bool, score_pad: int | None = None):
    """The base model an adapter goes on, in eval mode, on the CPU; with `score_pad` (a reward model's adapter) as a
    sequence classifier with one output that finds each sequence's last token by that pad id."""
    from transformers import AutoModelForSequenceClassification

    head = {}
    if score_pad is not None:
        head = {"num_labels": 1, "pad_token_id": score_pad}
    try:
        auto = AutoModelForSequenceClassification if score_pad is not None else generative(base, trust_remote_code)
        model = auto.from_pretrained(
            base, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code, **head
        )
    except (OSError, ValueError) as e:
        raise FtError(
            f"cannot load the base model {base!r}: {first_line(e)}\n    fix: pass --base with a local folder "
            "holding config.json and safetensors weights (or a hub id, online)"
        ) from None
    return model.eval()


def load_model(src: ModelSource, tokenizer, dtype, device):
    """The model in eval mode on `device`; an adapter is merged into its base in memory (faster to generate)."""
    if src.adapter is None:
        model = _full_model(src, dtype, device)
    else:
        model = load_base(src.model, dtype, src.trust_remote_code)
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))  # training grew them for added tokens
        model = merge_adapter(attach(model, Path(src.adapter), src.model, src.where), Path(src.adapter))
    return model.to(device).eval()


def generative(model: str, trust_remote_code: bool):
    """transformers' auto class that generates text with the model at `model`: AutoModelForImageTextToText for a
    vision-language model (its vision tower and projector loaded with it), else AutoModelForCausalLM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    vision = getattr(config, "vision_config", None) is not None
    return (
        AutoModelForImageTextToText
        if vision and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        else AutoModelForCausalLM
    )


def _full_model(src: ModelSource, dtype, device):
    # straight onto the GPU, not through host memory
    placed = {"device_map": {"": device}} if device.type == "cuda" else {}
    try:
        return generative(src.model, src.trust_remote_code).from_pretrained(
            src.model, dtype=dtype, trust_remote_code=src.trust_remote_code, **placed
        )
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e) and not src.trust_remote_code:
            raise FtError(
                f"the model {src.model!r} ({src.where}) ships its own Python code, which ft runs only when asked.\n"
                "    fix: read that code; if you trust it, pass --trust-remote-code (a saved config.yaml never "
                "turns it on)"
            ) from None
        raise FtError(
            f"cannot load the model {src.model!r} ({src.where}): {first_line(e)}\n"
            "    fix: pass a folder holding config.json and the weights, a hub id (online), or ft-tiny"
        ) from None


# ---------------------------------------------------------------- adapters
def adapter_shapes(adapter: Path) -> dict[str, tuple[int, ...]]:
    """lora_A/lora_B weight name -> shape, read from the safetensors header (no tensors loaded)."""
    from safetensors import safe_open

    path = adapter / "adapter_model.safetensors"
    if not path.is_file():
        return {}  # a .bin adapter: peft checks it on load
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if ".lora_A." in k or ".lora_B." in k}


def _features(module) -> tuple[int, int] | None:
    """(in, out) features of a linear-like module, None for kinds this check does not know."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.in_features), int(module.out_features)
    if type(module).__name__ == "Conv1D":  # GPT-2 style: weight is (in, out)
        return tuple(int(s) for s in module.weight.shape)
    return None


def _mismatches(model, shapes: dict[str, tuple[int, ...]]):
    """Modules the adapter has weights for: those the base lacks, and those whose shapes differ."""
    missing, wrong = [], []
    for key, shape in shapes.items():
        path, kind = key.removeprefix("base_model.model.").split(".lora_")[0], key.split(".lora_")[1][0]
        path = path.replace(".base_layer", "")  # peft nests one lora.ParamWrapper per adapted parameter of a module
        try:
            feats = _features(model.get_submodule(path))
        except AttributeError:
            missing.append(path)
            continue
        if feats is None or len(shape) != 2 or ".lora_embedding" in key:
            continue
        adapter_side, base_side = (shape[1], feats[0]) if kind == "A" else (shape[0], feats[1])
        if adapter_side != base_side:
            wrong.append((path, "input" if kind == "A" else "output", adapter_side, base_side))
    return sorted(set(missing)), list({w[0]: w for w in reversed(wrong)}.values())[::-1]  # first mismatch per module


def check_fits(model, adapter: Path, base: str, where: str) -> None:
    """FtError when the adapter's weights do not fit the base: modules it lacks, or other sizes.
    `where` names the setting that chose the base ("--base", "model.name in RUN/config.yaml", ...)."""
    missing, wrong = _mismatches(model, adapter_shapes(adapter))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise FtError(
            f"the adapter {adapter} does not fit the base {base} ({where}): the base has no module {shown}.\n    "
            "fix: pass --base with the model the adapter was trained on"
        )
    if not wrong:
        return
    hidden = getattr(model.config.get_text_config(), "hidden_size", None)
    ours = [w for w in wrong if w[1] == "input" and w[3] == hidden]
    head = (
        f"the adapter was trained for a base with hidden size {ours[0][2]}; {where} points at a model with "
        f"{hidden} ({base})"
        if ours
        else f"the adapter's layer sizes differ from those of the base {base} ({where})"
    )
    detail = "; ".join(f"{p}: {side} size {a} in the adapter, {b} in the base" for p, side, a, b in wrong[:3])
    raise FtError(f"{head}.\n    e.g. {detail}\n    fix: pass --base with the model the adapter was trained on")


def attach(model, adapter: Path, base: str, where: str):
    """PeftModel of base+adapter (checked with check_fits first); peft's errors and adapter modules the file has no
    weights for become FtErrors."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    check_fits(model, adapter, base, where)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as e:
        raise FtError(
            f"peft cannot apply the adapter {adapter} to the base {base} ({where}): {first_line(e)}\n    fix: "
            "pass --base with the model the adapter was trained on"
        ) from None
    shapes = adapter_shapes(adapter)
    if shapes:
        unfilled = sorted(
            k
            for k in get_peft_model_state_dict(peft_model, save_embedding_layers=False)
            if (".lora_A." in k or ".lora_B." in k) and k not in shapes
        )
        if unfilled:
            raise FtError(
                f"the adapter {adapter} has no weights for {len(unfilled)} adapter modules peft created on the "
                f"base {base} ({where}) (e.g. {unfilled[0]}): the base has layers the adapter was not trained "
                "with.\n    fix: pass --base with the model the adapter was trained on"
            )
    return peft_model.eval()


def merge_adapter(peft_model, adapter: Path):
    """The base with the adapter folded into its weights (peft's safe merge: NaNs are refused)."""
    try:
        return peft_model.merge_and_unload(safe_merge=True).eval()
    except ValueError as e:  # safe_merge found NaNs
        raise FtError(
            f"merging {adapter} gives broken weights: {first_line(e)}\n    fix: check the adapter (it may have "
            "diverged in training), or merge to --dtype fp32"
        ) from None
