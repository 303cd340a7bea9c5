"""`ft merge-lora`: fold a LoRA adapter into its base and save a plain transformers model.

The source is an adapter folder (peft format) or an ft run folder (`RUN/config.yaml` + `RUN/final/`).
The adapter is checked against the base before peft sees it, so a mismatch is explained rather than
dumped as a traceback. The merge is verified: logits of base+adapter (unmerged) on a few seeded random
inputs are compared with the merged model's. The output is written to a temporary folder next to
out_dir and renamed at the end, so a folder at out_dir is always complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError

DTYPES = ("auto", "bf16", "fp16", "fp32")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CHECK_LEN = 16  # tokens per verification sequence
CHECK_SEED = 0


@dataclass(frozen=True)
class MergeReport:
    """What merge_lora wrote and how well the merged model agrees with base+adapter."""

    out_dir: Path
    base: str
    adapter: Path
    dtype: str
    max_abs_logit_diff: float  # nan when check_inputs == 0
    shards: int
    params: int
    qlora: bool = False  # adapter trained on a 4-bit base; merged into the unquantized base
    tokenizer: str = ""  # where the saved tokenizer came from ("" when none was found)
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The report as lines for the terminal."""
        diff = "not checked" if math.isnan(self.max_abs_logit_diff) else f"{self.max_abs_logit_diff:.3g}"
        out = [
            f"merged {self.adapter} into {self.base}",
            f"  wrote      {self.out_dir} ({self.shards} safetensors shard{'s' if self.shards != 1 else ''}, "
            f"{self.params:,} parameters, {self.dtype})",
            f"  check      max |logit(base+adapter) - logit(merged)| = {diff}",
            f"  tokenizer  {self.tokenizer or 'none found (copy one into the folder before use)'}",
        ]
        if self.qlora:
            out.append(
                "  qlora      adapter trained on a 4-bit base; merged into the base loaded unquantized "
                "(dequantized base)"
            )
        out += [f"  note       {n}" for n in self.notes]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass(frozen=True)
class _Source:
    adapter: Path
    run: Path | None
    run_config: dict  # RUN/config.yaml as written by ft train ({} for an adapter folder)
    run_plan: dict  # RUN/plan.json: the resolved adapter/quantization when the config said auto ({} when absent)
    tokenizer_dirs: tuple[Path, ...]  # where to look for the tokenizer, in order


# ---------------------------------------------------------------- inputs
def _read_yaml(path: Path) -> dict:
    """A run's config.yaml as a mapping, with `${VAR}` (how ft writes values that came from the environment)
    expanded from this process's environment."""
    import os

    import yaml

    from finetune.config.env import Expansion

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise FtError(f"{path}: cannot read the run's config: {e}") from None
    if not isinstance(data, dict):
        raise FtError(
            f"{path}: expected a job config (a mapping with model, adapter, ...), found {type(data).__name__}"
        )
    expansion = Expansion(os.environ, yaml.safe_load)
    data = expansion.value(data)
    if expansion.problems:
        raise FtError(
            f"{path}: {expansion.problems[0].message}; set the variable the run was started with, or edit the file"
        )
    return data


def _read_plan(path: Path) -> dict:
    try:
        plan = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}  # the plan only refines what config.yaml says; a damaged one is not worth failing for
    return plan if isinstance(plan, dict) else {}


def _check_adapter_folder(folder: Path, what: str) -> None:
    if not (folder / "adapter_config.json").is_file():
        hint = (
            " It holds config.json: it is a full model already, there is nothing to merge."
            if (folder / "config.json").is_file()
            else ""
        )
        raise FtError(
            f"{what} {folder} has no adapter_config.json, so it is not a peft adapter.{hint}\n    fix: point ft "
            "merge-lora at a folder saved by peft (adapter_config.json + adapter_model.safetensors) or at an ft "
            "run folder"
        )
    if not any((folder / f).is_file() for f in ADAPTER_FILES):
        raise FtError(
            f"{what} {folder} has adapter_config.json but no adapter_model.safetensors: the adapter's weights "
            "are missing.\n    fix: copy the weights next to adapter_config.json, or use a complete checkpoint"
        )


def _resolve_source(source: str | Path) -> _Source:
    """An adapter folder or a run folder (config.yaml + final/); anything else is an FtError."""
    src = Path(source).expanduser()
    if not src.is_dir():
        raise FtError(
            f"{src}: no such folder.\n    fix: pass an adapter folder (adapter_config.json + "
            "adapter_model.safetensors) or an ft run folder (config.yaml + final/)"
        )
    if (src / "config.yaml").is_file() and (src / "final").is_dir():
        cfg, plan = _read_yaml(src / "config.yaml"), _read_plan(src / "plan.json")
        if "full" in (str((cfg.get("adapter") or {}).get("type", "")), plan.get("adapter")):
            raise FtError(
                f"{src}: this run trained all weights; {src / 'final'} is already a full model, there is nothing "
                "to merge"
            )
        _check_adapter_folder(src / "final", "the run's final folder")
        tok = (cfg.get("model") or {}).get("tokenizer")
        dirs = [src / "final"] + ([Path(tok)] if tok and Path(tok).is_dir() else [])
        return _Source(adapter=src / "final", run=src, run_config=cfg, run_plan=plan, tokenizer_dirs=tuple(dirs))
    if (src / "adapter_config.json").is_file() or any((src / f).is_file() for f in ADAPTER_FILES):
        _check_adapter_folder(src, "the adapter folder")
        return _Source(adapter=src, run=None, run_config={}, run_plan={}, tokenizer_dirs=(src,))
    if (src / "config.json").is_file():
        raise FtError(
            f"{src} holds config.json and no adapter_config.json: it is a full model, there is nothing to "
            "merge.\n    fix: pass the adapter folder (or the run folder) and give this model as --base"
        )
    found = ", ".join(sorted(p.name for p in src.iterdir())[:8]) or "nothing"
    raise FtError(
        f"{src} is neither an adapter folder nor an ft run folder (it holds: {found}).\n"
        "    expected: an adapter folder with adapter_config.json + adapter_model.safetensors,\n"
        "              or a run folder with config.yaml and final/ (the adapter saved by ft train)"
    )


def _resolve_base(base: str | None, src: _Source) -> tuple[str, str]:
    """(path or hub id, where it was named): --base, else the run's model.name, else the adapter's
    base_model_name_or_path."""
    if base:
        name, where = str(base), "--base"
    elif (src.run_config.get("model") or {}).get("name"):
        name, where = str(src.run_config["model"]["name"]), f"model.name in {src.run / 'config.yaml'}"
    else:
        cfg = json.loads((src.adapter / "adapter_config.json").read_text())
        name, where = (
            cfg.get("base_model_name_or_path") or "",
            f"base_model_name_or_path in {src.adapter / 'adapter_config.json'}",
        )
        if not name:
            raise FtError(
                f"{src.adapter}: the adapter does not name its base model.\n    fix: pass --base with the folder "
                "or hub id of the model it was trained on"
            )
    from finetune.models import BUILT_IN

    if name.lower() in BUILT_IN and not Path(name).exists():
        from finetune.config.schema import ModelSection
        from finetune.models import model_path

        return model_path(ModelSection(name=name)), where
    path = Path(name).expanduser()
    if (path.is_absolute() or name.startswith(".")) and not path.is_dir():
        raise FtError(
            f"{where}: the base model folder {name} does not exist.\n    fix: pass --base with the folder "
            "(config.json + safetensors) or hub id of the base"
        )
    return (str(path) if path.exists() else name), where


def _is_qlora(src: _Source) -> bool:
    """True when the run trained on a 4-bit base: config.yaml says so, or plan.json resolved auto to it."""
    adapter = str((src.run_config.get("adapter") or {}).get("type", ""))
    quant = str((src.run_config.get("quantization") or {}).get("type", ""))
    return "qlora" in (adapter, src.run_plan.get("adapter")) or "nf4" in (quant, src.run_plan.get("quantization"))


def _resolve_dtype(dtype: str, base: str, trust_remote_code: bool):
    """("bf16", torch.bfloat16) etc.; "auto" follows the base's config, fp32 when it says nothing."""
    import torch

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype not in DTYPES:
        raise FtError(f"--dtype {dtype!r}: not a dtype ft merges to.\n    fix: use one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype, names[dtype]
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FtError(
            f"cannot read the base model's config from {base!r}: {_first_line(e)}\n    fix: pass --base with a "
            "local folder holding config.json (or a hub id, online)"
        ) from None
    found = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    for name, value in names.items():
        if found == value:
            return name, value
    return "fp32", torch.float32


def _first_line(e: BaseException) -> str:
    """The line of an exception worth showing: a size mismatch when torch lists them, else the first line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    sizes = [line for line in lines if line.startswith("size mismatch")]
    return (
        (sizes[0] + (f" (and {len(sizes) - 1} more)" if len(sizes) > 1 else ""))
        if sizes
        else (lines[0] if lines else type(e).__name__)
    )


# ---------------------------------------------------------------- out_dir
def _check_out_dir(out: Path, overwrite: bool, reads: list[Path]) -> None:
    """Refuse a non-empty out_dir (unless overwrite) and any out_dir that holds or is an input."""
    for src in reads:
        if src.exists() and (out.resolve() == src.resolve() or out.resolve() in src.resolve().parents):
            raise FtError(
                f"out_dir {out} is or contains {src}, which the merge reads.\n    fix: write the merged model to "
                "a new folder"
            )
    if out.exists() and not out.is_dir():
        raise FtError(f"out_dir {out} is a file.\n    fix: choose a folder path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FtError(
            f"out_dir {out} is not empty.\n    fix: choose an empty or new folder, or pass --overwrite to "
            "replace its contents"
        )


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished tmp folder to out, replacing what is there; out is never half-written."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- models
def _load_base(base: str, dtype, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            base, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise FtError(
            f"cannot load the base model {base!r}: {_first_line(e)}\n    fix: pass --base with a local folder "
            "holding config.json and safetensors weights (or a hub id, online)"
        ) from None
    return model.eval()


def _load_tokenizer(dirs: list[Path], base: str, trust_remote_code: bool):
    """(tokenizer, where it came from): the first folder with tokenizer files, else the base's, else (None, "")."""
    from transformers import AutoTokenizer

    for where in [*(str(d) for d in dirs if any((d / f).is_file() for f in TOKENIZER_FILES)), base]:
        try:
            return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code), where
        except (OSError, ValueError, TypeError):
            continue
    return None, ""


def _adapter_shapes(adapter: Path) -> dict[str, tuple[int, ...]]:
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


def _check_fits(model, adapter: Path, base: str, where: str) -> None:
    """FtError when the adapter's weights do not fit the base: modules it lacks, or other sizes.
    `where` names the setting that chose the base ("--base", "model.name in RUN/config.yaml", ...)."""
    missing, wrong = _mismatches(model, _adapter_shapes(adapter))
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


def _attach(model, adapter: Path, base: str, where: str):
    """PeftModel of base+adapter; peft's errors and unfilled adapter modules become FtErrors."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    _check_fits(model, adapter, base, where)
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as e:
        raise FtError(
            f"peft cannot apply the adapter {adapter} to the base {base} ({where}): {_first_line(e)}\n    fix: "
            "pass --base with the model the adapter was trained on"
        ) from None
    shapes = _adapter_shapes(adapter)
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


def _check_tokens(model, n: int):
    """n seeded random sequences of CHECK_LEN token ids valid for the model; None when n == 0."""
    import torch

    vocab = model.get_input_embeddings().weight.shape[0]
    return (
        torch.randint(0, vocab, (n, CHECK_LEN), generator=torch.Generator().manual_seed(CHECK_SEED)) if n > 0 else None
    )


def _logits(model, tokens):
    import torch

    if tokens is None:
        return None
    with torch.no_grad():
        return model(input_ids=tokens.to(model.device)).logits.float().cpu()


def _merge(peft_model, adapter: Path):
    try:
        return peft_model.merge_and_unload(safe_merge=True).eval()
    except ValueError as e:  # safe_merge found NaNs
        raise FtError(
            f"merging {adapter} gives broken weights: {_first_line(e)}\n    fix: check the adapter (it may have "
            "diverged in training), or merge to --dtype fp32"
        ) from None


def _save(model, tokenizer, tmp: Path, max_shard_size: str) -> int:
    """Save weights (safetensors, sharded above max_shard_size) and tokenizer; return the shard count."""
    model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    shards = len(list(tmp.glob("*.safetensors")))
    if shards == 0:
        raise FtError(f"transformers wrote no safetensors files to {tmp}; the merged model was not saved")
    return shards


# ---------------------------------------------------------------- the verb
def _merged_model(
    base: str, where: str, src: _Source, torch_dtype, tokenizer, check_inputs: int, trust_remote_code: bool
):
    """(merged model, max |logit diff| base+adapter vs merged, notes)."""
    model = _load_base(base, torch_dtype, trust_remote_code)
    notes = []
    rows = model.get_input_embeddings().weight.shape[0]
    if tokenizer is not None and len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer))  # as training did for added tokens
        notes.append(f"grew the base's embeddings from {rows} to {len(tokenizer)} rows to match the tokenizer")
    peft_model = _attach(model, src.adapter, base, where)
    tokens = _check_tokens(model, check_inputs)
    before = _logits(peft_model, tokens)  # kept: merging rewrites the base's weights in place
    merged = _merge(peft_model, src.adapter)
    after = _logits(merged, tokens)
    diff = math.nan if before is None else float((before - after).abs().max())
    return merged, diff, notes


def _write_record(report: MergeReport, folder: Path) -> None:
    record = {k: (str(v) if isinstance(v, Path) else v) for k, v in report.__dict__.items()}
    record["max_abs_logit_diff"] = None if math.isnan(report.max_abs_logit_diff) else report.max_abs_logit_diff
    record["notes"] = list(report.notes)
    (folder / "ft_merge.json").write_text(json.dumps(record, indent=2) + "\n")


def _check_args(max_shard_size: str | int, check_inputs: int) -> None:
    size = str(max_shard_size).strip()
    if (
        not re.fullmatch(r"\d+(\.\d+)?\s*([KMGT]i?B)?", size, flags=re.IGNORECASE)
        or float(re.match(r"[\d.]+", size)[0]) <= 0
    ):
        raise FtError(f"--max-shard-size {max_shard_size!r}: not a size.\n    fix: write it like 2GB, 500MB or 200KB")
    if check_inputs < 0:
        raise FtError(f"--check-inputs {check_inputs}: must be 0 (no check) or more")


def merge_lora(
    source: str | Path,
    out_dir: str | Path,
    base: str | None = None,
    dtype: str = "auto",
    max_shard_size: str = "2GB",
    check_inputs: int = 4,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> MergeReport:
    """Merge the adapter at `source` (adapter folder or run folder) into its base; save to out_dir."""
    src = _resolve_source(source)
    base_name, where = _resolve_base(base, src)
    _check_args(max_shard_size, check_inputs)
    out = Path(out_dir).expanduser()
    _check_out_dir(out, overwrite, [p for p in (src.adapter, src.run, Path(base_name)) if p is not None])
    dtype_name, torch_dtype = _resolve_dtype(dtype, base_name, trust_remote_code)
    tokenizer, tok_from = _load_tokenizer(list(src.tokenizer_dirs), base_name, trust_remote_code)
    merged, diff, notes = _merged_model(base_name, where, src, torch_dtype, tokenizer, check_inputs, trust_remote_code)
    qlora = _is_qlora(src)
    if qlora:
        notes.append(
            "the check compares with base+adapter on the unquantized base; the 4-bit model used in training "
            "differs from both by the quantization error"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not mkdtemp: its 0700 mode would make the published folder private
    try:
        shards = _save(merged, tokenizer, tmp, max_shard_size)
        report = MergeReport(
            out_dir=out,
            base=base_name,
            adapter=src.adapter,
            dtype=dtype_name,
            max_abs_logit_diff=diff,
            shards=shards,
            params=sum(p.numel() for p in merged.parameters()),
            qlora=qlora,
            tokenizer=tok_from,
            notes=tuple(notes),
        )
        _write_record(report, tmp)
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return report
