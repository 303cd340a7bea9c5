"""`ft export RUN --gguf [--quant KIND]`: the trained model as one GGUF file for llama.cpp, and an Ollama Modelfile.

The source is what `ft generate` accepts: a run folder, a model folder or an adapter folder (with its base). An
adapter is folded into its base by ft merge-lora's merge (a QLoRA base is loaded unquantized: the merged model is
dequantized) and the merge is checked as there. The model is written with the gguf package (gguf_file.py: f32,
f16 or bf16), quantized by llama.cpp where a quantized kind is asked (quantize.py), loaded back with llama.cpp and
compared with transformers (checks.py), then published: OUT/model-KIND.gguf, OUT/Modelfile, OUT/ft_export.json,
each written to a temporary file and renamed; nothing else in OUT is touched. OUT defaults to RUN/export/gguf-KIND.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from finetune.artifacts import RunFolder
from finetune.errors import FtError
from finetune.export.gguf_file import FLOAT_TYPES
from finetune.export.quantize import QUANTS

KINDS = (*FLOAT_TYPES, *QUANTS)


@dataclass(frozen=True)
class ExportReport:
    """What export_gguf wrote and how the file compares with the transformers model."""

    path: Path
    modelfile: Path
    kind: str
    arch: str
    tensor_types: dict
    tokenizer: str  # llama.cpp's tokenizer model and pre-tokenizer, e.g. "gpt2 (starcoder)"
    template: str  # the built-in the job's chat template maps to for Ollama ("" when none)
    merge_logit_diff: float  # base+adapter vs merged (nan: no adapter)
    checked_texts: int  # 0: not checked
    max_abs_logit_diff: float  # llama.cpp vs transformers (nan: not checked)
    top_token_agreement: float
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        types = ", ".join(f"{n} {t}" for t, n in sorted(self.tensor_types.items(), key=lambda kv: -kv[1]))
        out = [
            f"wrote {self.path} ({self.arch}, {self.kind}; tensors: {types})",
            f"  ollama     {self.modelfile} (template: {self.template or 'none mapped; see the file'})",
            f"  tokenizer  {self.tokenizer}",
        ]
        if not math.isnan(self.merge_logit_diff):
            out.append(f"  merge      max |logit(base+adapter) - logit(merged)| = {self.merge_logit_diff:.3g}")
        if self.checked_texts:
            out.append(
                f"  check      llama.cpp tokenizes {self.checked_texts} probe texts as transformers does; max "
                f"|logit(llama.cpp) - logit(transformers)| = {self.max_abs_logit_diff:.3g}, same top token at "
                f"{self.top_token_agreement:.0%} of positions"
            )
        out += [f"  note       {n}" for n in self.notes]
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


# ---------------------------------------------------------------- sources that are not exported as they are
def _unconsolidated(path: Path) -> FtError | None:
    """The error for a checkpoint, or a run folder holding checkpoints and no final/: `ft consolidate` first."""
    from finetune.artifacts.run import checkpoint_step, is_checkpoint

    if is_checkpoint(path):
        run, step = RunFolder(path.parent.parent), checkpoint_step(path)
    else:
        run = RunFolder(path)
        if not run.is_run() or run.final.is_dir() or not run.checkpoints():
            return None
        step = checkpoint_step(run.checkpoints()[-1])
    plan = run.plan_dict() if run.plan_path.is_file() else {}
    ranks = int(plan.get("tensor_parallel") or 1)
    how = f"tensor-parallel over {ranks} ranks" if ranks > 1 else f"as {plan.get('backend') or 'its engine'} wrote it"
    out = run.consolidated_dir / run.checkpoint(step).name  # where ft consolidate writes it
    return FtError(
        f"{path}: checkpoint step {step} is sharded {how} and not yet consolidated into one model; GGUF is written "
        f"from a whole model.\n    fix: ft consolidate {run.path} --step {step}\n         then: ft export {out} --gguf"
    )


# ---------------------------------------------------------------- the merged model
@dataclass
class _Loaded:
    model: object
    tokenizer: object
    row: object  # the Family row (families.py)
    template_spec: str
    merge_diff: float
    notes: list
    name: str = "model"  # general.name in the file: the source folder's name


def _family(src, trust_remote_code: bool):
    """The family row of the model `src` names, from its config alone (before minutes of loading)."""
    from transformers import AutoConfig

    from finetune.export.families import family

    try:
        config = AutoConfig.from_pretrained(src.model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FtError(
            f"cannot read the config of {src.describe()}: {e}\n    fix: pass a folder with config.json"
        ) from None
    return family(config, src.describe())


def _load(source: str | Path, base: str | None, trust_remote_code: bool) -> _Loaded:
    from finetune.artifacts import find_adapter, find_tokenizer, load_model, load_tokenizer, resolve
    from finetune.merge import merged_model, resolve_dtype

    path = Path(source).expanduser()
    refused = _unconsolidated(path) if path.is_dir() else None
    if refused is not None:
        raise refused
    src = resolve(str(source), base, trust_remote_code)
    adapter = find_adapter(path) if src.adapter is not None else None
    if adapter is not None and adapter.scores:
        raise FtError(
            f"cannot export {path} as GGUF: it is a reward model's adapter (a sequence-classification head that "
            "scores text), which llama.cpp does not run as a language model.\n    fix: export the policy trained "
            "with it; the reward model itself stays a transformers model (ft eval, GRPO rewards)"
        )
    row = _family(src, trust_remote_code)
    _, dtype = resolve_dtype("auto", src.model, trust_remote_code)
    if adapter is None:
        import torch

        tokenizer = load_tokenizer(src)
        model = load_model(src, tokenizer, dtype, torch.device("cpu"))
        return _Loaded(model, tokenizer, row, src.template, math.nan, [], path.resolve().name)
    tokenizer, _ = find_tokenizer(list(adapter.tokenizer_dirs), src.model, trust_remote_code)
    if tokenizer is None:
        raise FtError(f"no tokenizer found for {src.describe()}.\n    fix: copy the tokenizer files into {path}")
    model, diff, notes = merged_model(src.model, src.where, adapter, dtype, tokenizer, 2, trust_remote_code)
    if adapter.qlora:
        notes.append("adapter trained on a 4-bit base: merged into the base loaded unquantized (dequantized)")
    return _Loaded(model, tokenizer, row, src.template, diff, notes, path.resolve().name)


def _template(loaded: _Loaded) -> tuple[str | None, str | None]:
    """(the job's chat template as Jinja, the built-in it maps to)."""
    from finetune.export.ollama import builtin_for
    from finetune.templates import TemplateError, resolve

    try:
        jinja = resolve(loaded.tokenizer, loaded.template_spec)
    except TemplateError:
        loaded.notes.append("no chat template (the tokenizer has none and the run named none): none written")
        return None, None
    return jinja, builtin_for(jinja, loaded.tokenizer)


# ---------------------------------------------------------------- output
def _out_dir(source: str | Path, out: str | Path | None, kind: str) -> Path:
    if out is not None:
        return Path(out).expanduser()
    run = RunFolder(Path(source))
    if run.is_run():
        return run.gguf_dir(kind)
    raise FtError(
        f"{source} is not a run folder, so ft export has no default place to write.\n    fix: pass --out FOLDER"
    )


def _targets(out: Path, kind: str, overwrite: bool) -> tuple[Path, Path, Path]:
    from finetune.artifacts.run import refuse_replacing_run

    if out.exists() and not out.is_dir():
        raise FtError(f"--out {out} is a file.\n    fix: choose a folder path")
    refuse_replacing_run(out, "--out")
    targets = (out / f"model-{kind}.gguf", out / "Modelfile", out / "ft_export.json")
    there = [t.name for t in targets if t.exists()]
    if there and not overwrite:
        raise FtError(
            f"--out {out} already holds {', '.join(there)}.\n    fix: choose another folder, or pass --overwrite to "
            "replace these files (nothing else in the folder is touched)"
        )
    return targets


def export_gguf(
    source: str | Path,
    out: str | Path | None = None,
    kind: str = "f16",
    base: str | None = None,
    overwrite: bool = False,
    check: bool = True,
    trust_remote_code: bool = False,
) -> ExportReport:
    """Write the model `source` names as a GGUF file of `kind` (KINDS) with an Ollama Modelfile into `out`."""
    if kind not in KINDS:
        raise FtError(f"--quant {kind!r}: not a kind ft writes.\n    fix: use one of {', '.join(KINDS)}")
    if kind in QUANTS:
        from finetune.export.quantize import llama_cpp

        llama_cpp()  # before minutes of loading: the binding is there
    folder = _out_dir(source, out, kind)
    gguf_path, modelfile_path, record_path = _targets(folder, kind, overwrite)
    loaded = _load(source, base, trust_remote_code)
    row = loaded.row
    jinja, mapped = _template(loaded)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".ft-export-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        written, checked, types = _write(tmp, loaded, row, kind, jinja, mapped, check)
        report = ExportReport(
            path=gguf_path,
            modelfile=modelfile_path,
            kind=kind,
            arch=row.arch,
            tensor_types=types,
            tokenizer=f"{written.vocab.model} ({written.vocab.pre}), {written.vocab.tokens} tokens",
            template=mapped or "",
            merge_logit_diff=loaded.merge_diff,
            checked_texts=checked.texts if checked else 0,
            max_abs_logit_diff=checked.max_abs_logit_diff if checked else math.nan,
            top_token_agreement=checked.top_token_agreement if checked else math.nan,
            notes=tuple(loaded.notes),
        )
        _publish(tmp, report, loaded, mapped, record_path)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _write(tmp: Path, loaded: _Loaded, row, kind: str, jinja, mapped, check: bool):
    """Write the file into tmp/model.gguf; (Written, Checked or None, tensor types)."""
    from finetune.export import checks, quantize
    from finetune.export.gguf_file import write_gguf
    from finetune.export.ollama import end_of_turn

    tokenizer_dir = tmp / "tokenizer"
    loaded.tokenizer.save_pretrained(str(tokenizer_dir))
    float_kind = kind if kind in FLOAT_TYPES else _float_for(loaded.model)
    meta = {"name": loaded.name, "chat_template": jinja, "eot": end_of_turn(mapped)}
    written = write_gguf(
        tmp / f"model-{float_kind}.gguf", loaded.model, loaded.tokenizer, tokenizer_dir, row, float_kind, meta
    )
    final = tmp / "model.gguf"
    if kind in FLOAT_TYPES:
        os.replace(written.path, final)
    else:
        quantize.quantize(written.path, final, kind)
        written.path.unlink()
        misfits = sum(1 for t in loaded.model.state_dict().values() if t.ndim == 2 and t.shape[-1] % 256)
        if "_k" in kind and misfits:
            loaded.notes.append(
                f"{misfits} matrices have rows whose length is not a multiple of 256, which {kind} needs: llama.cpp "
                "stored them in a type whose block fits (see the tensor types above)"
            )
    checked = None
    if check and importlib.util.find_spec("llama_cpp") is None:
        loaded.notes.append(f"not loaded back with llama.cpp (no llama-cpp-python here: {quantize.INSTALL})")
    elif check:
        checked = checks.check(final, loaded.model, loaded.tokenizer, jinja)
    return written, checked, quantize.tensor_types(final)


def _float_for(model) -> str:
    """The float type a quantized file is made from: bf16 for a bf16 model, else f16."""
    import torch

    return "bf16" if model.get_input_embeddings().weight.dtype == torch.bfloat16 else "f16"


def _publish(tmp: Path, report: ExportReport, loaded: _Loaded, mapped, record_path: Path) -> None:
    from finetune.export.ollama import modelfile
    from finetune.files import atomic_write_text

    text = modelfile(report.path.name, mapped, loaded.tokenizer.eos_token)
    os.replace(tmp / "model.gguf", report.path)
    atomic_write_text(report.modelfile, text)
    record = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(report).items()}
    for key in ("merge_logit_diff", "max_abs_logit_diff", "top_token_agreement"):
        record[key] = None if math.isnan(record[key]) else record[key]
    record["notes"] = list(report.notes)
    atomic_write_text(record_path, json.dumps(record, indent=2) + "\n")
