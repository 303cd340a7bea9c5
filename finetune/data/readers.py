"""Local data files -> records, one at a time, each with the `file:line` it came from.

Every way a file can be wrong gets its own message naming the file, and the line where the problem is
in one: compressed, binary or UTF-16 files, text that is not UTF-8, lines that are not JSON, records
nested too deeply or holding unpaired surrogates, lines over the size limit, broken CSV quoting, damaged
parquet. A bad record either stops the read (the default) or, with `data.skip_bad_records`, is counted
and the first few are named; a bad file always stops it. Lines are read with a bounded buffer, so a huge
line costs time proportional to its size and never more memory than the limit.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Callable, Iterator

from finetune.errors import DataError

Progress = Callable[[str, int, int], None]  # (stage, done, total)
ORIGIN = "_origin"
MAX_EXAMPLES = 5
MAX_LINE_BYTES = 16 << 20  # one record (one line) at most; longer lines are refused, never read whole
MAX_DEPTH = 64  # nesting levels of lists/objects in one record
NOT_UTF8 = "not UTF-8 text"
SKIP_FIX = "correct or remove the record, or set data.skip_bad_records: true to skip (and count) bad records"
_SNIFF = 4096
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SPACE = re.compile(r"[ \t\r\n]*")
_TOO_DEEP = f"the record is nested too deeply (more than {MAX_DEPTH} levels of lists/objects)"
_SIGNATURES = (  # (leading bytes, what the file is, how to fix it)
    (b"\x1f\x8b", "gzip-compressed", "decompress it first: gunzip -k FILE (and name the result .jsonl/.csv/...)"),
    (
        b"PK\x03\x04",
        "a zip archive (xlsx and docx files are zip archives too)",
        "unzip it, or export the sheet as .csv or .jsonl",
    ),
    (b"BZh", "bzip2-compressed", "decompress it first: bunzip2 -k FILE"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first: unxz -k FILE"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first: unzstd FILE"),
    (b"PAR1", "a parquet file", "give it the .parquet extension"),
    (b"\xff\xfe", "UTF-16 (or UTF-32) text", "save it as UTF-8: iconv -f utf-16 -t utf-8 FILE > OUT"),
    (b"\xfe\xff", "UTF-16 (big-endian) text", "save it as UTF-8: iconv -f utf-16 -t utf-8 FILE > OUT"),
)


def error(where: str, what: str, fix: str = "") -> DataError:
    """A DataError reading "WHERE: WHAT" and, on the next line, the fix."""
    return DataError(f"{where}: {what}" + (f"\n    fix: {fix}" if fix else ""))


def kind(value: object) -> str:
    """How a JSON value's type reads in a message: 'a number', 'a list', 'null', ..."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def short(value: object) -> str:
    """A value's repr for a message, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def warn_skipped(log: logging.Logger, source: str, skipped: int, examples: list[str]) -> None:
    """Log the records of `source` that data.skip_bad_records skipped, naming the first few."""
    log.warning(
        "%s: skipped %d bad record%s (data.skip_bad_records); first: %s",
        source,
        skipped,
        "s" if skipped != 1 else "",
        "; ".join(examples[:MAX_EXAMPLES]),
    )


def mib(size: int) -> str:
    """A size as people read it: 50.0 MiB, 12 KiB, 900 bytes."""
    if size >= 1 << 20:
        return f"{size / (1 << 20):.1f} MiB"
    return f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} bytes"


class Collector:
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
            raise error(origin, f"the column {ORIGIN!r} is reserved by ft", f"rename the column {ORIGIN!r} in the data")
        record[ORIGIN] = origin
        self.records.append(record)

    def bad(self, origin: str, reason: str) -> None:
        if not self.skip:
            raise error(origin, reason, SKIP_FIX)
        self.skipped += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{origin}: {reason}")


# ---------------------------------------------------------------- whole files
def sniff(path: str) -> None:
    """Refuse a file that is not text data at all: compressed, an archive, UTF-16, binary."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF)
    for signature, what, fix in _SIGNATURES:
        if head.startswith(signature):
            return _refuse(path, f"the file is {what}, not UTF-8 text", fix)
    if len(head) >= 8 and head[1::2].count(0) > len(head) // 4:
        return _refuse(
            path,
            "the file looks like UTF-16 text without a byte-order mark (every other byte is NUL), not UTF-8",
            "save it as UTF-8: iconv -f utf-16le -t utf-8 FILE > OUT",
        )
    if b"\x00" in head and not _utf8(head):
        return _refuse(
            path,
            f"the file looks binary (it holds NUL bytes and bytes that are not UTF-8 in its first {len(head)} bytes)",
            "point data.datasets[].path at the text data (.jsonl, .json, .csv, .txt) or a .parquet file",
        )
    return None


def _refuse(path: str, what: str, fix: str) -> None:
    raise error(path, what, fix.replace("FILE", path))


def _utf8(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"  # a character cut by the end of the sample
    return True


def lines(path: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(1-based line number, text without the line break, None) or (number, None, why it cannot be read).

    A line over MAX_LINE_BYTES is skipped over in chunks, never held whole."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                size = len(raw)
                while (more := f.readline(1 << 20)) and not more.endswith(b"\n"):
                    size += len(more)
                yield number, None, _too_long(size + len(more))
                continue
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n"), None
            except UnicodeDecodeError as e:
                yield (
                    number,
                    None,
                    f"{NOT_UTF8} (byte {e.start + 1} of the line); save the file as UTF-8, e.g. iconv -f latin1 "
                    "-t utf-8 IN > OUT",
                )


def _too_long(size: int) -> str:
    return (
        f"the line is {mib(size)}, over ft's limit of {mib(MAX_LINE_BYTES)} for one record (only the first "
        "data.seq_len tokens of a record are trained anyway); split the document into several records"
    )


# ---------------------------------------------------------------- one JSON record
def parse(text: str) -> tuple[object, str | None]:
    """(value, None) for a line of JSON, or (None, what is wrong with it)."""
    if text.startswith("\ufeff"):
        return None, "the line starts with a byte-order mark (U+FEFF), as when files are joined with cat; remove it"
    try:
        value = _DECODER.decode(text)
    except _Constant as e:
        return None, f"the line holds {e}, which JSON does not allow; write null or a number (as text if it must stay)"
    except RecursionError:
        return None, _TOO_DEEP
    except json.JSONDecodeError as e:
        if "\x00" in text:
            return (
                None,
                f"the line holds a NUL byte (column {text.index(chr(0)) + 1}): it is damaged or binary, not JSON",
            )
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    return value, check(value, text)


class _Constant(Exception):
    """NaN, Infinity or -Infinity in a line: Python's json reads them, JSON (and Arrow text columns) do not."""


def _no_constant(name: str):
    raise _Constant(name)


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def check(value: object, text: str) -> str | None:
    """What makes a parsed record unusable: nesting over MAX_DEPTH, or an unpaired surrogate escape."""
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth_over(value):
        return _TOO_DEEP
    if _SURROGATE_ESCAPE.search(text):
        bad = _surrogate(value)
        if bad is not None:
            return (
                f"the record holds an unpaired surrogate escape ({bad}), which is not text; write the character "
                "itself, or a valid pair"
            )
    return None


def _depth_over(value: object) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def _surrogate(value: object) -> str | None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and not item.isascii():
            found = next((c for c in item if "\ud800" <= c <= "\udfff"), None)
            if found is not None:
                return f"\\u{ord(found):04x}"
    return None


# ---------------------------------------------------------------- readers: file -> records
def read_json_lines(path: str, out: Collector) -> None:
    for number, text, problem in lines(path):
        origin = f"{path}:{number}"
        if problem:
            out.bad(origin, problem)
        elif text.strip():
            value, problem = parse(text)
            out.bad(origin, problem) if problem else out.add(value, origin)


def read_json(path: str, out: Collector) -> None:
    """A .json file holds either one list of records, or one record per line."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    start = len(text) - len(text.lstrip())
    if text[start : start + 1] == "[":
        _read_json_array(path, text, start, out)
    else:
        read_json_lines(path, out)


def _read_json_array(path: str, text: str, pos: int, out: Collector) -> None:
    pos += 1
    while True:
        pos = _SPACE.match(text, pos).end()
        if text.startswith("]", pos):
            return
        where = f"{path}:{text.count(chr(10), 0, pos) + 1}"
        try:
            record, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise error(
                f"{path}:{e.lineno}",
                f"not valid JSON ({e.msg} at column {e.colno})",
                "correct the file: a .json file holds one list of records, [{...}, {...}], or one record per line (a "
                "broken list cannot be skipped record by record)",
            ) from None
        except RecursionError:
            raise error(where, _TOO_DEEP, "flatten the record") from None
        except _Constant as e:
            raise error(
                where, f"the record holds {e}, which JSON does not allow", "write null or a number instead"
            ) from None
        problem = check(record, text[pos:end])
        out.bad(where, problem) if problem else out.add(record, where)
        pos = _SPACE.match(text, end).end()
        if text.startswith(",", pos):
            pos += 1
        elif not text.startswith("]", pos):
            raise error(
                f"{path}:{text.count(chr(10), 0, pos) + 1}",
                "not valid JSON (expected ',' or ']' between records)",
                "correct the file: a .json file holds one list of records, [{...}, {...}], or one record per line",
            )


def not_utf8(path: str) -> DataError:
    line = next((number for number, _, problem in lines(path) if problem and problem.startswith(NOT_UTF8)), None)
    return error(
        f"{path}:{line}" if line else path, NOT_UTF8, "save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 IN > OUT"
    )


def read_txt(path: str, out: Collector) -> None:
    for number, text, problem in lines(path):
        problem = problem or ("the line holds a NUL byte: the file is damaged or binary" if "\x00" in text else None)
        if problem:
            out.bad(f"{path}:{number}", problem)
        elif text.strip():
            out.add({"text": text}, f"{path}:{number}")


def read_csv(path: str, out: Collector) -> None:
    """Every value is read as a string (CSV has no types); row N is the Nth record after the header."""
    old_limit = csv.field_size_limit()
    csv.field_size_limit(MAX_LINE_BYTES)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            _csv_rows(path, csv.reader(f, strict=True), out)
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    finally:
        csv.field_size_limit(old_limit)


def _csv_rows(path: str, rows, out: Collector) -> None:
    header, number = None, 0
    while True:
        start = rows.line_num + 1
        try:
            row = next(rows, None)
        except csv.Error as e:
            raise error(
                f"{path}:{start}",
                f"not valid CSV ({e}; the row that starts on this line runs to line {rows.line_num})",
                'close the quotes (a quote inside a quoted value is written twice: ""), or convert the file to .jsonl',
            ) from None
        if row is None:
            return
        if header is None:
            header = _check_header(path, row)
        elif row:
            number += 1
            origin = f"{path}:row {number}"
            if len(row) != len(header):
                out.bad(origin, f"{len(row)} values, but the header names {len(header)} columns (line {start})")
            elif any("\x00" in value for value in row):
                out.bad(origin, f"a value holds a NUL byte (line {start}): the file is damaged or binary")
            else:
                out.add(dict(zip(header, row)), origin)


def _check_header(path: str, header: list[str]) -> list[str]:
    seen = set()
    for i, name in enumerate(header, 1):
        if not name.strip() or name in seen:
            what = "has no name" if not name.strip() else f"repeats the name {name!r}"
            raise error(
                f"{path}:1", f"header column {i} {what}", "give every CSV column a unique name in the first line"
            )
        seen.add(name)
    return header


def read_parquet(path: str, out: Collector) -> None:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise error(path, f"not a readable parquet file ({e})", "rewrite the file, or convert it to .jsonl") from None
    for number, record in enumerate(table.to_pylist(), 1):
        out.add(record, f"{path}:row {number}")


READERS: dict[str, Callable[[str, Collector], None]] = {
    ".jsonl": read_json_lines,
    ".json": read_json,
    ".csv": read_csv,
    ".parquet": read_parquet,
    ".txt": read_txt,
}
