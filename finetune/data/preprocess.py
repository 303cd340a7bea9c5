"""`ft preprocess`: sources -> canonical records -> tokens and loss masks -> mixed, split, packed, cached.

Runs once, before any training process starts (`ft train` calls `prepare` first); concurrent callers
of the same data wait on a file lock instead of tokenizing in parallel, so no rank ever sits in a
collective while another tokenizes. The cache key covers everything that changes the output.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from finetune.config.schema import Config, DatasetSpec
from finetune.data.readers import Progress
from finetune.data.rows import Rows
from finetune.errors import DataError, FtError

DATA_VERSION = 3  # bump when the output of this pipeline changes for the same inputs
TEMPLATED = ("chat", "instruction", "preference", "prompt_only", "unpaired")


@dataclass(frozen=True)
class Prepared:
    """The prepared data: datasets on disk (memory-mapped), its summary and cache entry."""

    train: Rows
    validation: Rows | None
    summary: dict
    path: Path
    added_tokens: tuple[str, ...]
    tokenizer: object
    built: bool  # False when a complete cache entry was reused
    processor: object = None  # a vision-language model's processor (finetune/vision.py)


def prepare(
    config: Config, *, force: bool = False, progress: Progress | None = None, tokens: Tokens | None = None
) -> Prepared:
    """Prepared data for `config`: from the cache when its fingerprint matches, else built (once). `tokens`: what
    `training_tokenizer(config)` returned, where the caller has it already."""
    from finetune.data.cache import DataCache, fingerprint
    from finetune.data.sources import check_paths

    problems = check_paths(config)
    if problems:
        raise DataError("\n".join(problems))
    tokens = tokens or training_tokenizer(config)
    tokenizer, jinja, added, processor = tokens
    key = fingerprint(fingerprint_parts(config, tokenizer, jinja, processor))
    cache = DataCache(config.data.cache_dir)
    with cache.lock(key):
        if cache.is_complete(key) and (force or _images_changed(cache.path(key))):
            cache.remove(key)
        built = not cache.is_complete(key)
        if built:
            from datasets import disable_progress_bars

            disable_progress_bars()
            with cache.build(key) as tmp:
                summary = build(config, tokenizer, jinja, tmp, progress or (lambda *_: None), processor)
                summary["added_tokens"] = added
                (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
    return _load(cache.path(key), tokens, built)


def _images_changed(root: Path) -> bool:
    """Whether an image the prepared data refers to is gone or has other content than when it was prepared: the
    images' files are part of the data's fingerprint, checked when the cache is reused."""
    from finetune.data.cache import file_digest

    try:
        images = json.loads((root / "summary.json").read_text()).get("image_files") or {}
        return any(file_digest(path) != digest for path, digest in images.items())
    except (OSError, ValueError, DataError):  # an unreadable summary, an image gone or unreadable
        return True


def load_prepared(config: Config, root: Path) -> Prepared:
    """The data a launcher prepared into cache entry `root` (a rank's view: no fingerprinting, no building)."""
    if not (root / "summary.json").is_file() or not (root / "train").is_dir():
        raise FtError(
            f"the prepared data {root} is missing or incomplete (removed while the job started?); run ft train "
            "again, which prepares it"
        )
    return _load(root, training_tokenizer(config), False)


def _load(root: Path, tokens: Tokens, built: bool) -> Prepared:
    """Cache entry `root`: its summary, and its training and (when there is one) validation split, memory-mapped."""
    summary = json.loads((root / "summary.json").read_text())
    validation = Rows.load(root / "validation") if (root / "validation").exists() else None
    train = Rows.load(root / "train")
    return Prepared(train, validation, summary, root, tuple(tokens.added), tokens.tokenizer, built, tokens.processor)


class Tokens(NamedTuple):
    """The tokenizer training uses (with the tokens the config and the template add), the template, and the added
    tokens."""

    tokenizer: object
    jinja: str | None
    added: tuple[str, ...]
    processor: object = None  # a vision-language model's processor (finetune/vision.py), whose tokenizer is `tokenizer`


def training_tokenizer(config: Config) -> Tokens:
    from finetune.models import add_special_tokens, load_tokenizer

    processor = None
    if vision_language(config):
        from finetune import vision
        from finetune.models import model_path

        processor = vision.load_processor(config.model, model_path(config.model), config.data.image)
        tokenizer = processor.tokenizer
        if getattr(processor, "chat_template", None) and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = processor.chat_template  # the template is the processor's (image markers)
    else:
        tokenizer = load_tokenizer(config.model)
    jinja, template_tokens = _template(config, tokenizer)
    added = add_special_tokens(tokenizer, [*config.data.add_special_tokens, *template_tokens])
    return Tokens(tokenizer, jinja, tuple(added), processor)


def vision_language(config: Config) -> bool:
    """Whether the job trains a vision-language model through its processor (config/vision_checks.py)."""
    from finetune.config.vision_checks import trains_images
    from finetune.models import facts as model_facts

    try:
        facts = model_facts(config.model)
    except Exception:  # noqa: BLE001 - a model the catalog cannot describe is loaded (and refused) as a text model
        return False
    return trains_images(config, facts)


def _template(config: Config, tokenizer) -> tuple[str | None, list[str]]:
    """The chat template text (None when no source needs one) and built-in tokens missing from the vocabulary."""
    from finetune.data.sources import specs
    from finetune.templates import missing_special_tokens, resolve

    if not any(s.format in TEMPLATED for _, s in specs(config)):
        return None, []
    return resolve(tokenizer, config.data.template), missing_special_tokens(tokenizer, config.data.template)


def fingerprint_parts(config: Config, tokenizer, jinja: str | None, processor=None) -> dict:
    """Everything that changes the prepared data; nothing else (not the output dir, not the model weights)."""
    from finetune.data.cache import file_digest
    from finetune.data.sources import resolve_files, specs

    # not the images per sample the plan assumes (data.image.per_sample): it changes no row
    data = config.data.model_dump(mode="json", exclude={"num_proc": True, "cache_dir": True, "image": {"per_sample"}})
    files = {}
    for _, spec in specs(config):
        paths = resolve_files(spec.path)
        files[spec.path] = (
            [(str(p), file_digest(p)) for p in paths]
            if paths is not None
            else {"hub": spec.path, "subset": spec.subset, "split": spec.split, "revision": spec.revision}
        )
    return {
        "version": DATA_VERSION,
        "data": data,
        "method": config.method.name,
        "max_new_tokens": config.method.completion_tokens(),
        "files": files,
        "tokenizer": tokenizer.backend_tokenizer.to_str()
        if hasattr(tokenizer, "backend_tokenizer")
        else repr(tokenizer),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
        "template": jinja,
        # how images become tokens (the images' own content is checked when the cache is reused: _images_changed)
        **({"image_processor": processor.image_processor.to_json_string()} if processor is not None else {}),
    }


def rules_for(config: Config, spec: DatasetSpec):
    from finetune.data.tokenize import Rules

    room = config.data.seq_len - config.method.completion_tokens()
    if spec.format == "prompt_only" and room < 1:
        raise FtError(
            f"method.max_new_tokens ({config.method.completion_tokens()}) leaves no room for a prompt in data.seq_len "
            f"({config.data.seq_len}); raise seq_len or lower max_new_tokens"
        )
    return Rules(spec.format, config.data.train_on, config.data.seq_len, config.data.overlong, room)


# ---------------------------------------------------------------- building
def build(config: Config, tokenizer, jinja: str | None, out: Path, progress: Progress, processor=None) -> dict:
    """Build the prepared data into `out`; return the summary."""
    from finetune.data.packing import efficiency, pack
    from finetune.data.sources import mix, split_validation
    from finetune.data.tokenize import SFT_FORMATS

    data = config.data
    counts: Counter = Counter()
    examples: list = []  # the first skipped records, with file:line and why
    parts = [
        _source(config, f"data.datasets[{i}]", spec, tokenizer, jinja, counts, progress, examples, processor)
        for i, spec in enumerate(data.datasets)
    ]
    train = mix(parts, data.seed)
    if isinstance(data.validation, DatasetSpec):
        validation = _source(
            config, "data.validation", data.validation, tokenizer, jinja, Counter(), progress, examples, processor
        )
    else:  # records repeated by weight/samples share an origin and stay on one side of the split
        train, validation = split_validation(train, data.validation, data.seed)
    train = train.remove_columns("_origin")
    validation = validation.remove_columns("_origin") if validation is not None else None
    lengths = train["length"][:]
    summary = _summary(counts, train, lengths, data.seq_len)
    if examples:
        summary["skipped_examples"] = examples[:5]
    if "images" in train.column_names:
        from finetune.data.cache import file_digest

        files = {p for rows in (train, validation) if rows is not None for ps in rows["images"][:] for p in ps}
        summary["image_files"] = {p: file_digest(p) for p in sorted(files)}
    if data.packing and all(s.format in SFT_FORMATS for s in data.datasets):
        progress("packing", 0, 1)
        train = pack(train, data.seq_len)
        validation = pack(validation, data.seq_len) if validation is not None else None
        summary["packed_rows"] = len(train)
        summary["packing_efficiency"] = round(efficiency(train, data.seq_len, packed=True), 4)
        progress("packing", 1, 1)
    if "images" in train.column_names:  # what the plan sizes the vision tower for (plan/vision.py)
        counts = [len(ps or ()) for ps in train["images"][:]]
        summary["max_images_per_row"] = max(counts, default=0)
        summary["rows_without_images"] = counts.count(0)  # DDP then searches for parameters a micro-batch leaves unused
    summary["validation_samples"] = len(validation) if validation is not None else 0
    train.save_to_disk(str(out / "train"))
    if validation is not None:
        validation.save_to_disk(str(out / "validation"))
    return summary


def _source(
    config: Config,
    key: str,
    spec: DatasetSpec,
    tokenizer,
    jinja,
    counts: Counter,
    progress: Progress,
    examples: list,
    processor=None,
):
    """One source: read, sample, normalize, tokenize, fit to seq_len."""
    from finetune.data.formats import normalize_dataset
    from finetune.data.sources import load_source, take

    data = config.data
    try:
        raw, stats = load_source(spec, skip_bad_records=data.skip_bad_records, progress=progress)
    except DataError as e:
        raise DataError(f"{key}: {e}") from None
    examples.extend(stats.skipped_examples)
    counts["read"] += stats.records_read
    counts["skipped_unreadable"] += stats.records_skipped
    norm, skipped = normalize_dataset(
        raw,
        spec,
        skip_bad_records=data.skip_bad_records,
        num_proc=data.num_proc,
        key=key,
        examples=examples,
        progress=progress,
    )
    counts["skipped_bad_records"] += skipped
    norm = take(norm, spec, data.seed)
    counts["sampled"] += len(norm)
    return tokenize_dataset(norm, rules_for(config, spec), tokenizer, jinja, counts, progress, key, data, processor)


def tokenize_dataset(ds, rules, tokenizer, jinja, counts: Counter, progress: Progress, key: str, data, processor=None):
    """Tokenize with `datasets.map`; count what happened to each record; drop the ones that cannot train."""
    total, done = len(ds), [0]
    if total == 0:
        raise DataError(f"{key}: no records to tokenize; check the file, its format and the sampling settings")

    def batch(records: dict) -> dict:
        n = len(records["_origin"])
        rows = [
            _one({k: v[i] for k, v in records.items()}, rules, tokenizer, jinja, data.skip_bad_records, key, processor)
            for i in range(n)
        ]
        if data.num_proc == 1:
            done[0] += n
            progress(f"tokenizing {key}", done[0], total)
        columns = list(rows[0]) if rows else []
        return {k: [r[k] for r in rows] for k in columns}

    # Our own cache keys the result; fresh fingerprints stop datasets from hashing the tokenizer closure.
    out = ds.map(
        batch,
        batched=True,
        batch_size=256,
        num_proc=data.num_proc if data.num_proc > 1 else None,
        remove_columns=ds.column_names,
        new_fingerprint=uuid.uuid4().hex,
    )
    status_column = out["_status"][:]  # datasets 5: [:] reads the column at once
    statuses = Counter(status_column)
    counts.update(statuses)
    progress(f"tokenizing {key}", total, total)
    keep = [i for i, s in enumerate(status_column) if s in ("kept", "truncated")]
    kept = out.select(keep).remove_columns("_status")
    if len(kept) == 0:
        raise DataError(
            f"{key}: no training examples left ({dict(statuses)}); check the format, columns, seq_len and "
            "train_on settings"
        )
    return kept


_EMPTY = {
    "chat": ("input_ids", "labels"),
    "instruction": ("input_ids", "labels"),
    "completion": ("input_ids", "labels"),
    "prompt_completion": ("input_ids", "labels"),
    "preference": ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"),
    "prompt_only": ("prompt_ids",),
    "unpaired": ("input_ids", "labels"),
}


def _one(rec: dict, rules, tokenizer, jinja, skip_bad: bool, key: str, processor=None) -> dict:
    from finetune.data.tokenize import fit_length, tokenize_record

    try:
        row, status = fit_length(tokenize_record(rec, rules, tokenizer, jinja, processor), rules)
    except FtError as e:
        if not skip_bad:
            raise DataError(
                f"{key}: {rec.get('_origin', '?')}: {e}\n    fix: correct or remove the record, or set "
                "data.skip_bad_records: true to skip (and count) such records"
            ) from None
        row, status = None, "skipped_bad_records"
    if row is None:
        row = {k: [] for k in _EMPTY[rules.format]} | {"length": 0}
        if rules.format == "prompt_only":
            row |= {"prompt": "[]", "extra": "{}"}
        if rules.format == "unpaired":
            row["desirable"] = False
        if rules.format == "preference":
            row["margin"] = None
        if processor is not None and rules.format in ("chat", "preference", "unpaired"):
            row["images"] = []
    return {**row, "_status": status, "_origin": rec.get("_origin", "?")}


def _summary(counts: Counter, train, lengths: list[int], seq_len: int) -> dict:
    from finetune.data.masking import IGNORE

    ordered = sorted(lengths)
    pct = (
        {f"p{p}": ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] for p in (50, 90, 99)} if ordered else {}
    )
    trained, share = 0, 0.0
    label_cols = [c for c in train.column_names if c.endswith("labels")]
    for col in label_cols[:1]:
        for labels in train[col][:]:
            n = sum(1 for t in labels[1:] if t != IGNORE)
            trained, share = trained + n, max(share, n / max(1, len(labels)))
    return {
        "records_read": counts["read"],
        "skipped_unreadable": counts["skipped_unreadable"],
        "records_sampled": counts["sampled"],
        "skipped_bad_records": counts["skipped_bad_records"],
        "truncated": counts["truncated"],
        "dropped_too_long": counts["dropped_long"],
        "dropped_nothing_to_train": counts["dropped_untrained"],
        "train_samples": len(train),
        "token_lengths": {
            **pct,
            "max": ordered[-1] if ordered else 0,
            "mean": round(sum(ordered) / max(1, len(ordered)), 1),
        },
        "tokens_per_epoch": sum(ordered),
        "trained_tokens_per_epoch": trained,
        # the largest share of a row's positions trained (rounded up): ft train plans with it, sizing the plain loss's
        # logits (plan/transients.py); packed rows, and micro-batches of rows, hold no larger share than their samples
        "most_trained_share": min(1.0, math.ceil(share * 10_000) / 10_000) if label_cols else 1.0,
        "padding_efficiency": round(sum(ordered) / max(1, len(ordered) * seq_len), 4),
    }
