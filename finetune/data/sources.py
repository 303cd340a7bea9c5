"""Reading one data source into a `datasets.Dataset`, and sampling, mixing and splitting sources.

A source is a local file (.jsonl, .json, .csv, .parquet, .txt), a glob, a folder of such files, or a
hub dataset id. Local files are parsed here, record by record, so that every record carries an
`_origin` column ("data/train.jsonl:17", "data/x.csv:row 5", "org/name[train]:row 5") that later stages
put in their error messages, and so that a malformed record is reported with its file and line.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import math
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.config.schema import DatasetSpec
from finetune.data.readers import ORIGIN, READERS, Collector, Progress, sniff, warn_skipped
from finetune.data.readers import error as _error
from finetune.errors import DataError

if TYPE_CHECKING:  # datasets, numpy and pyarrow load in the functions that use them: `ft validate` stays fast
    import datasets

SUPPORTED = (".jsonl", ".json", ".csv", ".parquet", ".txt")
_GLOB_CHARS = re.compile(r"[*?\[]")
log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------- public entry points
def load_source(
    spec: DatasetSpec, *, skip_bad_records: bool = False, progress: Progress | None = None
) -> tuple[datasets.Dataset, SourceStats]:
    """Read every record of `spec.path` (local file, glob, folder or hub id) with an `_origin` column.

    progress, when given, is called as progress(stage, files done, files) after each file."""
    files = resolve_files(spec.path)
    if files is None:
        return _load_hub(spec)
    out = Collector(skip_bad_records)
    for done, file in enumerate(files):
        _read_file(file, out)
        if progress is not None:
            progress(f"reading {spec.path}", done + 1, len(files))
    if not out.records:
        raise _error(
            spec.path,
            f"no usable records: all {out.skipped} were bad; first: {out.examples[0]}",
            "fix the data, or point data.datasets[].path at the intended file",
        )
    if out.skipped:
        warn_skipped(log, spec.path, out.skipped, out.examples)
    stats = SourceStats(spec.path, len(out.records), out.skipped, tuple(out.examples), tuple(files))
    return to_dataset(out.records), stats


def _read_file(file: str, out: Collector) -> None:
    """Append one file's records to `out`; DataError naming the file when it cannot be read at all."""
    before = len(out.records) + out.skipped
    suffix = Path(file).suffix.lower()
    try:
        if suffix != ".parquet":
            sniff(file)
        READERS[suffix](file, out)
    except OSError as e:  # removed, unreadable or a folder since resolve_files looked at it
        raise _error(
            file, f"cannot read the file ({e.strerror or e})", "check that it exists and is readable (ls -l)"
        ) from None
    if len(out.records) + out.skipped == before:
        raise _error(file, "the file holds no records", "remove the empty file or fill it")


def specs(config) -> list[tuple[str, DatasetSpec]]:
    """The data sources of `config` with their keys: each data.datasets[i], then data.validation when it is a source."""
    out = [(f"data.datasets[{i}]", s) for i, s in enumerate(config.data.datasets)]
    if isinstance(config.data.validation, DatasetSpec):
        out.append(("data.validation", config.data.validation))
    return out


def check_paths(config) -> list[str]:
    """One message per local data path of `config` that cannot be read (missing, FIFO, unreadable, ...).

    Hub dataset ids are not checked (that needs the network). Relative paths are read from the current folder."""
    problems = []
    for key, spec in specs(config):
        try:
            resolve_files(spec.path)
        except DataError as e:
            problems.append(f"{key}.path: {e}")
    return problems


def resolve_files(path: str) -> list[str] | None:
    """The local files a source path names, sorted; None when it is a hub dataset id."""
    expanded = os.path.expanduser(path)
    if _GLOB_CHARS.search(expanded):
        matched = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
        files = [p for p in matched if Path(p).suffix.lower() in SUPPORTED]
        if not files:
            found = f" (matched only: {', '.join(matched[:5])})" if matched else ""
            raise _error(
                path,
                f"no {'/'.join(SUPPORTED)} files match this pattern{found}",
                f"check the pattern; relative paths are read from {os.getcwd()}",
            )
        return _readable(files)
    if os.path.isdir(expanded):
        return _readable(_folder_files(path, expanded))
    if os.path.isfile(expanded):
        if Path(expanded).suffix.lower() not in SUPPORTED:
            raise _error(
                path,
                "unsupported file type "
                f"{repr(Path(expanded).suffix) if Path(expanded).suffix else '(no extension)'}; ft reads "
                f"{', '.join(SUPPORTED)}",
                "convert the file to .jsonl (one JSON record per line)",
            )
        return _readable([expanded])
    _not_a_file(path, expanded)
    if looks_like_hub_id(path):
        return None
    raise DataError(
        f"data file not found: {path}\n    fix: check the path (relative paths are read from {os.getcwd()}), or "
        "give a hub dataset id such as org/name"
    )


def _not_a_file(path: str, expanded: str) -> None:
    """Raise for a path that exists (or is a link) but is neither a regular file nor a folder."""
    try:
        mode = os.stat(expanded).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _error(
                path,
                "is a symbolic link that loops back on itself",
                "point the link at the data file, or give the file's own path",
            ) from None
        if os.path.islink(expanded):
            raise _error(
                path,
                f"is a symbolic link to {os.readlink(expanded)}, which does not exist",
                "fix the link, or give the data file's own path",
            ) from None
        if e.errno == errno.EACCES:
            raise _error(
                path,
                "cannot be looked at: permission denied on a folder above it",
                "make the folders readable, or copy the data somewhere readable",
            ) from None
        return
    what = {
        stat.S_IFIFO: "a named pipe (FIFO)",
        stat.S_IFSOCK: "a socket",
        stat.S_IFCHR: "a character device",
        stat.S_IFBLK: "a block device",
    }
    name = what.get(stat.S_IFMT(mode), "not a regular file")
    raise _error(
        path,
        f"is {name}, not a regular file; ft reads a data file twice (to fingerprint it for the cache, then to read it)",
        "write the data to a regular file first, e.g. cat PIPE > data.jsonl, and point data.datasets[].path at it",
    )


def _readable(files: list[str]) -> list[str]:
    for file in files:
        if not os.access(file, os.R_OK):
            raise _error(
                file,
                "cannot be read: permission denied",
                f"make it readable (chmod a+r {file}), or run ft as a user who can read it",
            )
    return files


def looks_like_hub_id(path: str) -> bool:
    """`org/name` or `name`: no leading . / ~, no glob characters, no file extension, at most one slash."""
    if not path or path[0] in "./~\\" or _GLOB_CHARS.search(path) or path.count("/") > 1:
        return False
    return not re.search(r"\.[A-Za-z][A-Za-z0-9]*$", path)


def _folder_files(path: str, expanded: str) -> list[str]:
    root = Path(expanded)
    files = sorted(
        str(p)
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in SUPPORTED
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise _error(
            path,
            f"the folder holds no {'/'.join(SUPPORTED)} files",
            "put data files in it, or point data.datasets[].path at a file",
        )
    return files


def to_dataset(records: list[dict]) -> datasets.Dataset:
    """One Arrow table from all records, every value read back exactly as parsed.

    A column whose values do not share one Arrow type (a number among strings, anywhere inside) is stored
    as JSON text that we encode ourselves: datasets' own mixed-type mode keeps a string that happens to be
    valid JSON ("1", "true") as is and reads it back as a number, so one odd record retyped good ones."""
    import datasets
    import pyarrow as pa

    keys = list(dict.fromkeys(k for r in records for k in r if k != ORIGIN)) + [ORIGIN]
    arrays = {}
    for key in keys:
        values = [r.get(key) for r in records]
        try:
            arrays[key] = pa.array(values)
        except (pa.ArrowException, OverflowError, ValueError, TypeError):  # mixed types; ints beyond 64 bits
            arrays[key] = pa.array(
                [None if v is None else json.dumps(v, ensure_ascii=False) for v in values], type=pa.json_()
            )
    return datasets.Dataset(pa.table(arrays))


def _load_hub(spec: DatasetSpec) -> tuple[datasets.Dataset, SourceStats]:
    import datasets

    try:
        ds = datasets.load_dataset(spec.path, name=spec.subset, split=spec.split, revision=spec.revision)
    except Exception as e:  # datasets raises many types (not found, offline, bad split); all mean the same to the user
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _error(
            spec.path,
            f"no such local file or folder, and loading it as a hub dataset failed: {reason}",
            f"check the path (relative paths are read from {os.getcwd()}), or the hub id, subset and split; "
            "offline, the dataset must already be in the datasets cache",
        ) from None
    if ORIGIN in ds.column_names:
        raise _error(spec.path, f"the column {ORIGIN!r} is reserved by ft", f"drop or rename the column {ORIGIN!r}")
    if len(ds) == 0:
        raise _error(
            spec.path, f"the split {spec.split!r} holds no records", "choose another split with data.datasets[].split"
        )
    name = f"{spec.path}[{spec.split}]"
    ds = ds.add_column(ORIGIN, [f"{name}:row {i + 1}" for i in range(len(ds))])
    return ds, SourceStats(spec.path, len(ds), 0)


# ---------------------------------------------------------------- sampling, mixing, splitting
def take(ds: datasets.Dataset, spec: DatasetSpec, seed: int) -> datasets.Dataset:
    """Apply spec.samples (an exact count) or spec.weight (a share): whole repeats plus a seeded random rest.

    weight 1 keeps every record once; 0.5 a random half (rounded, at least one record); 2 every record
    twice; 1.5 every record once plus a random half. The subset depends on the seed and the source path.
    """
    import numpy as np

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
    from datasets import concatenate_datasets

    ds = concatenate_datasets(aligned) if len(aligned) > 1 else first
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
        f"cannot mix sources of different shapes: source 1 ({_name(first)}) has {_shape(first)}; source {number} "
        f"({_name(part)}) has {_shape(part)}\n    fix: sources mixed together must be read in compatible formats (chat "
        "and instruction both give messages); train on the others in a separate job"
    )


def _name(ds: datasets.Dataset) -> str:
    return ds[0][ORIGIN] if ORIGIN in ds.column_names and len(ds) else "empty"


def _shape(ds: datasets.Dataset) -> str:
    return ", ".join(f"{k}: {v}" for k, v in ds.features.items() if k != ORIGIN)


def split_validation(
    ds: datasets.Dataset, fraction: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Hold out `fraction` of the records (at least one) for evaluation; 0 holds out nothing.

    Records are grouped by `_origin`, so a record repeated by weight or samples lands entirely on one
    side: the held-out part never leaks into training, and holds each of its records once.
    """
    import numpy as np

    if not 0 <= fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0:
        return ds, None
    origins = ds[ORIGIN][:] if ORIGIN in ds.column_names else list(range(len(ds)))  # [:]: a list, read at once
    unique = list(dict.fromkeys(origins))
    n_val = max(1, math.floor(fraction * len(unique) + 0.5))
    if n_val >= len(unique):
        raise DataError(
            f"data.validation: holding out {fraction} of {len(unique)} distinct "
            f"record{'s' if len(unique) != 1 else ''} "
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
