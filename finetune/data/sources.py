"""Reading one data source into a `datasets.Dataset`, and sampling, mixing and splitting sources.

A source is a local file (.jsonl, .json, .csv, .parquet, .txt), a glob, a folder of such files, or a
hub dataset id. Local files are parsed here, record by record, so that every record carries an
`_origin` column ("data/train.jsonl:17", "data/x.csv:row 5", "org/name[train]:row 5") that later stages
put in their error messages, and so that a malformed record is reported with its file and line.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from finetune.config.schema import DatasetSpec
from finetune.errors import DataError

SUPPORTED = (".jsonl", ".json", ".csv", ".parquet", ".txt")
ORIGIN = "_origin"
MAX_EXAMPLES = 5
SKIP_FIX = "correct or remove the record, or set data.skip_bad_records: true to skip (and count) bad records"
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class SourceStats:
    """What reading one source found. records_read counts the records kept, records_skipped the bad ones."""

    path: str
    records_read: int
    records_skipped: int
    skipped_examples: tuple[str, ...] = ()
    """Up to 5 skipped records as "ORIGIN: REASON"."""
    files: tuple[str, ...] = ()
    """The local files read, in order (empty for hub data)."""


def _error(where: str, what: str, fix: str = "") -> DataError:
    return DataError(f"{where}: {what}" + (f"\n    fix: {fix}" if fix else ""))


class _Collector:
    """Records read so far; a bad record either raises (strict) or is counted (skip_bad_records)."""

    def __init__(self, skip: bool):
        self.skip = skip
        self.records: list[dict] = []
        self.skipped = 0
        self.examples: list[str] = []

    def add(self, record: object, origin: str) -> None:
        if not isinstance(record, dict):
            return self.bad(origin, f"a record must be a JSON object ({{...}}), got {kind(record)}")
        if ORIGIN in record:
            raise _error(origin, f"the column {ORIGIN!r} is reserved by ft", f"rename the column {ORIGIN!r} in the data")
        record[ORIGIN] = origin
        self.records.append(record)

    def bad(self, origin: str, reason: str) -> None:
        if not self.skip:
            raise _error(origin, reason, SKIP_FIX)
        self.skipped += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{origin}: {reason}")


def kind(value: object) -> str:
    """How a JSON value's type reads in a message: 'a number', 'a list', 'null', ..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------- public entry points
def load_source(spec: DatasetSpec, *, skip_bad_records: bool = False) -> tuple[datasets.Dataset, SourceStats]:
    """Read every record of `spec.path` (local file, glob, folder or hub id) with an `_origin` column."""
    files = resolve_files(spec.path)
    if files is None:
        return _load_hub(spec)
    out = _Collector(skip_bad_records)
    for file in files:
        before = len(out.records) + out.skipped
        _READERS[Path(file).suffix.lower()](file, out)
        if len(out.records) + out.skipped == before:
            raise _error(file, "the file holds no records", "remove the empty file or fill it")
    if not out.records:
        raise _error(spec.path, f"no usable records: all {out.skipped} were bad; first: {out.examples[0]}", "fix the data, or point data.datasets[].path at the intended file")
    stats = SourceStats(spec.path, len(out.records), out.skipped, tuple(out.examples), tuple(files))
    return _to_dataset(out.records), stats


def resolve_files(path: str) -> list[str] | None:
    """The local files a source path names, sorted; None when it is a hub dataset id."""
    expanded = os.path.expanduser(path)
    if _GLOB_CHARS.search(expanded):
        matched = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        files = [p for p in matched if Path(p).suffix.lower() in SUPPORTED]
        if not files:
            found = f" (matched only: {', '.join(matched[:5])})" if matched else ""
            raise _error(path, f"no {'/'.join(SUPPORTED)} files match this pattern{found}", f"check the pattern; relative paths are read from {os.getcwd()}")
        return files
    if os.path.isdir(expanded):
        return _folder_files(path, expanded)
    if os.path.isfile(expanded):
        if Path(expanded).suffix.lower() not in SUPPORTED:
            raise _error(path, f"unsupported file type {repr(Path(expanded).suffix) if Path(expanded).suffix else '(no extension)'}; ft reads {', '.join(SUPPORTED)}", "convert the file to .jsonl (one JSON record per line)")
        return [expanded]
    if looks_like_hub_id(path):
        return None
    raise DataError(f"data file not found: {path}\n    fix: check the path (relative paths are read from {os.getcwd()}), or give a hub dataset id such as org/name")


def looks_like_hub_id(path: str) -> bool:
    """`org/name` or `name`: no leading . / ~, no glob characters, no file extension, at most one slash."""
    if not path or path[0] in "./~\\" or _GLOB_CHARS.search(path) or path.count("/") > 1:
        return False
    return not re.search(r"\.[A-Za-z][A-Za-z0-9]*$", path)


def _folder_files(path: str, expanded: str) -> list[str]:
    root = Path(expanded)
    files = sorted(
        str(p) for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in SUPPORTED and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise _error(path, f"the folder holds no {'/'.join(SUPPORTED)} files", "put data files in it, or point data.datasets[].path at a file")
    return files


def _to_dataset(records: list[dict]) -> datasets.Dataset:
    """One Arrow table from all records; a column whose type varies between records is stored as JSON."""
    keys = list(dict.fromkeys(k for r in records for k in r if k != ORIGIN)) + [ORIGIN]
    columns = {k: [r.get(k) for r in records] for k in keys}
    return datasets.Dataset.from_dict(columns, on_mixed_types="use_json")


def _load_hub(spec: DatasetSpec) -> tuple[datasets.Dataset, SourceStats]:
    try:
        ds = datasets.load_dataset(spec.path, name=spec.subset, split=spec.split, revision=spec.revision)
    except Exception as e:  # datasets raises many types (not found, offline, bad split); all mean the same to the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _error(spec.path, f"no such local file or folder, and loading it as a hub dataset failed: {reason}",
                     f"check the path (relative paths are read from {os.getcwd()}), or the hub id, subset and split; offline, the dataset must already be in the datasets cache") from None
    if ORIGIN in ds.column_names:
        raise _error(spec.path, f"the column {ORIGIN!r} is reserved by ft", f"drop or rename the column {ORIGIN!r}")
    if len(ds) == 0:
        raise _error(spec.path, f"the split {spec.split!r} holds no records", "choose another split with data.datasets[].split")
    name = f"{spec.path}[{spec.split}]"
    ds = ds.add_column(ORIGIN, [f"{name}:row {i + 1}" for i in range(len(ds))])
    return ds, SourceStats(spec.path, len(ds), 0)


# ---------------------------------------------------------------- readers: file -> records
def _lines(path: str) -> Iterator[tuple[int, str | None]]:
    """(1-based line number, text without the line break, or None when the line is not UTF-8)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                yield number, None


def _read_json_lines(path: str, out: _Collector) -> None:
    for number, text in _lines(path):
        origin = f"{path}:{number}"
        if text is None:
            out.bad(origin, "not UTF-8 text")
        elif text.strip():
            try:
                out.add(json.loads(text), origin)
            except json.JSONDecodeError as e:
                out.bad(origin, f"not valid JSON ({e.msg} at column {e.colno})")


def _read_json(path: str, out: _Collector) -> None:
    """A .json file holds either one list of records, or one record per line."""
    text = _read_text(path)
    start = len(text) - len(text.lstrip())
    if text[start:start + 1] == "[":
        _read_json_array(path, text, start, out)
    else:
        _read_json_lines(path, out)


def _read_json_array(path: str, text: str, pos: int, out: _Collector) -> None:
    decoder = json.JSONDecoder()
    pos, line, counted = pos + 1, 1, 0
    while True:
        pos = _skip_space(text, pos)
        if text.startswith("]", pos):
            return
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise _json_syntax(path, e) from None
        out.add(record, f"{path}:{line}")
        pos = _skip_space(text, pos)
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("]", pos):
            line_no = text.count("\n", 0, pos) + 1
            raise _error(f"{path}:{line_no}", "not valid JSON (expected ',' or ']' between records)", "correct the file: a .json file holds one list of records, [{...}, {...}], or one record per line")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _json_syntax(path: str, e: json.JSONDecodeError) -> DataError:
    return _error(f"{path}:{e.lineno}", f"not valid JSON ({e.msg} at column {e.colno})",
                  "correct the file: a .json file holds one list of records, [{...}, {...}], or one record per line (a broken list cannot be skipped record by record)")


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.read()
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _not_utf8(path: str) -> DataError:
    line = next((number for number, text in _lines(path) if text is None), None)
    return _error(f"{path}:{line}" if line else path, "not UTF-8 text", "save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 IN > OUT")


def _read_txt(path: str, out: _Collector) -> None:
    for number, text in _lines(path):
        if text is None:
            out.bad(f"{path}:{number}", "not UTF-8 text")
        elif text.strip():
            out.add({"text": text}, f"{path}:{number}")


def _read_csv(path: str, out: _Collector) -> None:
    """Every value is read as a string (CSV has no types); row N is the Nth record after the header."""
    old_limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # long documents in one cell
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            rows = csv.reader(f)
            header = next(rows, None)
            if header is not None:
                _check_header(path, header)
                _csv_rows(path, header, rows, out)
    except csv.Error as e:
        raise _error(path, f"not valid CSV ({e})", "fix the quoting in the file, or convert it to .jsonl") from None
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    finally:
        csv.field_size_limit(old_limit)


def _csv_rows(path: str, header: list[str], rows: Iterator[list[str]], out: _Collector) -> None:
    number = 0
    for row in rows:
        if not row:
            continue
        number += 1
        if len(row) != len(header):
            out.bad(f"{path}:row {number}", f"{len(row)} values, but the header names {len(header)} columns")
        else:
            out.add(dict(zip(header, row)), f"{path}:row {number}")


def _check_header(path: str, header: list[str]) -> None:
    seen = set()
    for i, name in enumerate(header, 1):
        if not name.strip() or name in seen:
            what = "has no name" if not name.strip() else f"repeats the name {name!r}"
            raise _error(f"{path}:1", f"header column {i} {what}", "give every CSV column a unique name in the first line")
        seen.add(name)


def _read_parquet(path: str, out: _Collector) -> None:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise _error(path, f"not a readable parquet file ({e})", "rewrite the file, or convert it to .jsonl") from None
    for number, record in enumerate(table.to_pylist(), 1):
        out.add(record, f"{path}:row {number}")


_READERS: dict[str, Callable[[str, _Collector], None]] = {
    ".jsonl": _read_json_lines, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet, ".txt": _read_txt,
}


# ---------------------------------------------------------------- sampling, mixing, splitting
def take(ds: datasets.Dataset, spec: DatasetSpec, seed: int) -> datasets.Dataset:
    """Apply spec.samples (an exact count) or spec.weight (a share): whole repeats plus a seeded random rest.

    weight 1 keeps every record once; 0.5 a random half (rounded, at least one record); 2 every record
    twice; 1.5 every record once plus a random half. The subset depends on the seed and the source path.
    """
    n = len(ds)
    target = spec.samples if spec.samples is not None else max(1, math.floor(spec.weight * n + 0.5))
    if n == 0 or target == n:
        return ds
    whole, rest = divmod(target, n)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, zlib.crc32(spec.path.encode())])
    picked = np.sort(rng.choice(n, size=rest, replace=False))
    return ds.select(np.concatenate([np.tile(np.arange(n), whole), picked]))


def mix(parts: list[datasets.Dataset], seed: int) -> datasets.Dataset:
    """Concatenate sources of the same shape and shuffle them with the seed."""
    if not parts:
        raise ValueError("mix() needs at least one dataset")
    first = parts[0]
    aligned = [first] + [_align(p, first, i) for i, p in enumerate(parts[1:], 2)]
    ds = datasets.concatenate_datasets(aligned) if len(aligned) > 1 else first
    return ds.shuffle(seed=seed)


def _align(part: datasets.Dataset, first: datasets.Dataset, number: int) -> datasets.Dataset:
    if part.features == first.features:
        return part
    if set(part.column_names) == set(first.column_names):
        try:
            return part.cast(first.features)
        except Exception:  # pyarrow/datasets cast errors: report the two shapes below
            pass
    raise DataError(
        f"cannot mix sources of different shapes: source 1 ({_name(first)}) has {_shape(first)}; source {number} ({_name(part)}) has {_shape(part)}"
        "\n    fix: sources mixed together must be read in compatible formats (chat and instruction both give messages); train on the others in a separate job"
    )


def _name(ds: datasets.Dataset) -> str:
    return ds[0][ORIGIN] if ORIGIN in ds.column_names and len(ds) else "empty"


def _shape(ds: datasets.Dataset) -> str:
    return ", ".join(f"{k}: {v}" for k, v in ds.features.items() if k != ORIGIN)


def split_validation(ds: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out `fraction` of the records (at least one) for evaluation; 0 holds out nothing.

    Records are grouped by `_origin`, so a record repeated by weight or samples lands entirely on one
    side: the held-out part never leaks into training, and holds each of its records once.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0:
        return ds, None
    origins = ds[ORIGIN][:] if ORIGIN in ds.column_names else list(range(len(ds)))  # [:]: a list, read at once
    unique = list(dict.fromkeys(origins))
    n_val = max(1, math.floor(fraction * len(unique) + 0.5))
    if n_val >= len(unique):
        raise DataError(
            f"data.validation: holding out {fraction} of {len(unique)} distinct record{'s' if len(unique) != 1 else ''} "
            f"({n_val}) leaves no training records\n    fix: lower data.validation, or add training data"
        )
    held = {unique[i] for i in np.random.default_rng(seed & 0xFFFFFFFF).permutation(len(unique))[:n_val]}
    train_rows, val_rows, seen = [], [], set()
    for row, origin in enumerate(origins):
        if origin not in held:
            train_rows.append(row)
        elif origin not in seen:
            seen.add(origin)
            val_rows.append(row)
    return ds.select(train_rows), ds.select(val_rows)
