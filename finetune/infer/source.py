"""What `ft generate` and `ft eval` load: a run folder, a full model folder, a peft adapter on its base,
a hub id, or ft-tiny. Adapters are found, checked against their base and merged in memory with the
helpers of `ft merge-lora`, so the two verbs accept the same folders and explain the same mistakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError

DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class ModelSource:
    """A model to load: `model` alone (a full model), or `model` as the base of `adapter`."""

    model: str  # folder or hub id
    adapter: str | None
    tokenizer_dirs: tuple[str, ...]  # folders tried for the tokenizer before `model`
    template: str  # the run's data.template; `tokenizer` when not from a run
    where: str  # which setting named `model`, for messages
    trust_remote_code: bool = False  # only from this invocation (--trust-remote-code), never from a saved file

    def describe(self) -> str:
        return f"{self.adapter} on {self.model}" if self.adapter else self.model


def resolve(source: str, base: str | None = None, trust_remote_code: bool = False) -> ModelSource:
    """The ModelSource a SOURCE argument (and --base) names; FtError with the fix when it names nothing usable."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _folder(path, base, trust_remote_code)
    from finetune.data.sources import looks_like_hub_id

    if not looks_like_hub_id(source):
        raise FtError(
            f"{source}: no such folder.\n    fix: pass a run folder (config.yaml + final/), a model folder "
            "(config.json), an adapter folder (adapter_config.json), a hub id or ft-tiny"
        )
    if base:
        raise FtError(
            f"--base is for adapters, but {source} names a model.\n    fix: drop --base, or pass the adapter folder"
        )
    from finetune.config.schema import ModelSection
    from finetune.models import model_path

    return ModelSource(
        model_path(ModelSection(name=source)), None, (), "tokenizer", "the model argument", trust_remote_code
    )


def _folder(path: Path, base: str | None, trust_remote_code: bool) -> ModelSource:
    from finetune import merge

    if (path / "config.yaml").is_file():
        run_config = merge._read_yaml(path / "config.yaml")
        template = str((run_config.get("data") or {}).get("template") or "tokenizer")
        trust = trust_remote_code  # never the run's own config.yaml: a run folder may come from anyone
        final = path / "final"
        if not final.is_dir():
            raise FtError(
                f"{path}: the run has no final/ folder: training has not finished.\n    fix: finish it (ft train "
                "CONFIG --resume), or pass a model folder"
            )
        if not (final / "adapter_config.json").is_file():
            _check_model_folder(final, f"the run's final folder {final}")
            return ModelSource(str(final), None, (), template, f"{final}", trust)
        return _adapter(merge._resolve_source(path), base, template, trust)
    if (path / "adapter_config.json").is_file():
        return _adapter(merge._resolve_source(path), base, "tokenizer", trust_remote_code)
    _check_model_folder(path, str(path))
    if base:
        raise FtError(f"--base is for adapters, but {path} holds a full model (config.json).\n    fix: drop --base")
    return ModelSource(str(path), None, (), "tokenizer", str(path), trust_remote_code)


def _adapter(src, base: str | None, template: str, trust: bool) -> ModelSource:
    from finetune import merge

    base_name, where = merge._resolve_base(base, src)
    return ModelSource(base_name, str(src.adapter), tuple(str(d) for d in src.tokenizer_dirs), template, where, trust)


def _check_model_folder(path: Path, what: str) -> None:
    if not (path / "config.json").is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise FtError(
            f"{what} holds neither config.json (a model) nor adapter_config.json (an adapter); it holds: {found}.\n"
            "    fix: pass a run folder (config.yaml + final/), a model folder or an adapter folder"
        )


def torch_dtype(name: str, device):
    """The dtype to generate in: `auto` is fp32 on CPU, bf16 on GPUs that support it, else fp16."""
    import torch

    if name not in DTYPES:
        raise FtError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def load_tokenizer(src: ModelSource):
    """The run's or adapter's saved tokenizer, else the model's; a pad token is set (EOS) when missing."""
    from finetune import merge

    tokenizer, _ = merge._load_tokenizer([Path(d) for d in src.tokenizer_dirs], src.model, src.trust_remote_code)
    if tokenizer is None:
        raise FtError(
            f"no tokenizer found for {src.describe()}.\n    fix: copy the tokenizer files (tokenizer.json, "
            "tokenizer_config.json) into the model folder"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(src: ModelSource, tokenizer, dtype, device):
    """The model in eval mode on `device`; an adapter is merged into its base in memory (faster to generate)."""
    from finetune import merge

    if src.adapter is None:
        model = _full_model(src, dtype, device)
    else:
        model = merge._load_base(src.model, dtype, src.trust_remote_code)
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))  # training grew them for added tokens
        model = merge._merge(merge._attach(model, Path(src.adapter), src.model, src.where), Path(src.adapter))
    return model.to(device).eval()


def _full_model(src: ModelSource, dtype, device):
    from transformers import AutoModelForCausalLM

    from finetune.merge import _first_line

    placed = (
        {"device_map": {"": device}} if device.type == "cuda" else {}
    )  # straight onto the GPU, not through host memory
    try:
        return AutoModelForCausalLM.from_pretrained(
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
            f"cannot load the model {src.model!r} ({src.where}): {_first_line(e)}\n"
            "    fix: pass a folder holding config.json and the weights, a hub id (online), or ft-tiny"
        ) from None
