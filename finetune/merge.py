"""`ft merge-lora`: fold a LoRA adapter into its base and save a plain transformers model.

The source is an adapter folder (peft format) or an ft run folder (`RUN/config.yaml` + `RUN/final/`).
The adapter is found, checked against the base and merged by finetune.artifacts (as for `ft generate`
and `ft eval`), so a mismatch is explained rather than dumped as a traceback. The merge is verified:
logits of base+adapter (unmerged) on a few seeded random inputs are compared with the merged model's.
The output is written to a temporary folder next to out_dir and renamed at the end, so a folder at
out_dir is always complete.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from finetune.artifacts import (
    DTYPES,
    AdapterSource,
    attach,
    dtypes,
    find_adapter,
    find_processor,
    find_tokenizer,
    first_line,
    load_base,
    merge_adapter,
)
from finetune.data.tokenize import pad_id
from finetune.errors import FtError

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


# ---------------------------------------------------------------- inputs
def resolve_dtype(dtype: str, base: str, trust_remote_code: bool):
    """("bf16", torch.bfloat16) etc.; "auto" follows the base's config, fp32 when it says nothing."""
    import torch

    names = dtypes()
    if dtype not in DTYPES:
        raise FtError(f"--dtype {dtype!r}: not a dtype ft merges to.\n    fix: use one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype, names[dtype]
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FtError(
            f"cannot read the base model's config from {base!r}: {first_line(e)}\n    fix: pass --base with a "
            "local folder holding config.json (or a hub id, online)"
        ) from None
    found = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found, None)
    for name, value in names.items():
        if found == value:
            return name, value
    return "fp32", torch.float32


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
    from finetune.artifacts.run import refuse_replacing_run

    refuse_replacing_run(out, "out_dir")
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


# ---------------------------------------------------------------- check and save
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


def _save(model, tokenizer, tmp: Path, max_shard_size: str, processor=None) -> int:
    """Save weights (safetensors, sharded above max_shard_size), a vision-language model's processor, and the
    tokenizer; return the shard count."""
    model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
    if processor is not None:  # image processor, chat template, and its tokenizer (the one found below wins)
        processor.save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    shards = len(list(tmp.glob("*.safetensors")))
    if shards == 0:
        raise FtError(f"transformers wrote no safetensors files to {tmp}; the merged model was not saved")
    return shards


# ---------------------------------------------------------------- the verb
def merged_model(
    base: str, where: str, src: AdapterSource, torch_dtype, tokenizer, check_inputs: int, trust_remote_code: bool
):
    """(merged model, max |logit diff| base+adapter vs merged, notes)."""
    score_pad = pad_id(tokenizer) if src.scores and tokenizer is not None else None
    model = load_base(base, torch_dtype, trust_remote_code, score_pad)
    notes = []
    rows = model.get_input_embeddings().weight.shape[0]
    if tokenizer is not None and len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer))  # as training did for added tokens
        notes.append(f"grew the base's embeddings from {rows} to {len(tokenizer)} rows to match the tokenizer")
    peft_model = attach(model, src.adapter, base, where)
    tokens = _check_tokens(model, check_inputs)
    before = _logits(peft_model, tokens)  # kept: merging rewrites the base's weights in place
    merged = merge_adapter(peft_model, src.adapter)
    after = _logits(merged, tokens)
    diff = math.nan if before is None else float((before - after).abs().max())
    return merged, diff, notes


RECORD = "README.md"  # the merged folder's model card, which holds the merge's record (front matter key `ft_merge`)


def _write_record(report: MergeReport, folder: Path) -> None:
    """The merged folder's README.md: a model card whose front matter records the merge (base, adapter, dtype, the
    logit check, notes). A card is a file every model folder may hold, so the folder stays what transformers and vLLM
    load as it is, with no file of ft's own."""
    record = {k: (str(v) if isinstance(v, Path) else v) for k, v in report.__dict__.items()}
    record["max_abs_logit_diff"] = None if math.isnan(report.max_abs_logit_diff) else report.max_abs_logit_diff
    record["notes"] = list(report.notes)
    write_record(folder, record)


def write_record(folder: Path, record: dict) -> None:
    """Write (or rewrite) the merged folder's card with `record` as its `ft_merge` front matter."""
    import yaml

    from finetune.files import atomic_write_text

    front = yaml.safe_dump({"library_name": "transformers", "tags": ["ft", "merged-lora"], "ft_merge": record})
    diff = record.get("max_abs_logit_diff")
    check = "not checked" if diff is None else f"max |logit(base+adapter) - logit(merged)| = {diff:.3g}"
    body = (
        f"# {Path(str(record.get('out_dir') or folder)).name}\n\nThe LoRA adapter `{record.get('adapter')}` merged "
        f"into its base `{record.get('base')}` by `ft merge-lora` ({record.get('dtype')}). Check on seeded random "
        f"inputs: {check}.\n" + "".join(f"\n- {n}" for n in record.get("notes") or []) + "\n"
    )
    atomic_write_text(folder / RECORD, f"---\n{front}---\n\n{body}")


def read_record(folder: Path) -> dict:
    """The merge's record from a merged folder's card ({} when the folder holds none)."""
    import yaml

    try:
        text = (Path(folder) / RECORD).read_text(encoding="utf-8")
        front = yaml.safe_load(text.split("---\n", 2)[1]) if text.startswith("---\n") else None
    except (OSError, IndexError, yaml.YAMLError):
        return {}
    record = front.get("ft_merge") if isinstance(front, dict) else None
    return record if isinstance(record, dict) else {}


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
    src = find_adapter(source)
    base_name, where = src.base(base)
    _check_args(max_shard_size, check_inputs)
    out = Path(out_dir).expanduser()
    _check_out_dir(out, overwrite, [p for p in (src.adapter, src.run, Path(base_name)) if p is not None])
    dtype_name, torch_dtype = resolve_dtype(dtype, base_name, trust_remote_code)
    tokenizer, tok_from = find_tokenizer(list(src.tokenizer_dirs), base_name, trust_remote_code)
    merged, diff, notes = merged_model(base_name, where, src, torch_dtype, tokenizer, check_inputs, trust_remote_code)
    qlora = src.qlora
    if qlora:
        notes.append(
            "the check compares with base+adapter on the unquantized base; the 4-bit model used in training "
            "differs from both by the quantization error"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # not mkdtemp: its 0700 mode would make the published folder private
    try:
        processor = None
        if getattr(merged.config, "vision_config", None) is not None:  # loads with AutoProcessor, as the base did
            processor = find_processor(list(src.tokenizer_dirs), base_name, trust_remote_code)
        shards = _save(merged, tokenizer, tmp, max_shard_size, processor)
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
