"""Bad training-data files, built deterministically, for fuzzing `ft preprocess`.

`cases()` lists every case: the file's name and bytes (or a special file kind: FIFO, folder, symlink
loop, ...), the data format and settings of the job that reads it, and what ft must say: the line the
message has to name (None when the problem is the whole file) and patterns the message must match.
Most cases are errors (exit code 2); those with `ok=True` are valid but awkward data (a BOM, a very long
conversation, skipped bad records) that must be prepared, in bounded time. `materialize(case, folder)`
writes the case's file and returns its path.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

GOOD = 40  # good records around a bad one: a bad record must not poison them, nor take their line number


@dataclass(frozen=True)
class Case:
    """One data file and what `ft preprocess` must do with it."""

    name: str
    file: str  # file name inside the case's folder
    body: bytes = b""
    format: str = "chat"
    line: int | None = None  # the line (CSV/parquet: row) the message must name
    expect: tuple[str, ...] = ()  # regexes, case-insensitive, the message must match
    data: dict = field(default_factory=dict)  # extra keys of the job's data section
    source: dict = field(default_factory=dict)  # extra keys of the job's data.datasets[0]
    kind: str = "file"  # file | fifo | dir | loop | dangling | unreadable | missing
    ok: bool = False  # valid data: must be prepared (exit 0)
    path: str = ""  # data.datasets[0].path when it is not the file itself (globs, folders)


# ---------------------------------------------------------------- good records per format
def good(fmt: str, i: int) -> dict:
    """A valid record of `fmt`, distinct for each i."""
    q, a = f"What is {i} plus one?", f"{i + 1}"
    turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {
        "chat": {"messages": turns},
        "instruction": {"instruction": q, "input": "", "output": a},
        "completion": {"text": f"{q} {a}"},
        "prompt_completion": {"prompt": q, "completion": a},
        "preference": {"prompt": q, "chosen": a, "rejected": f"{i - 1}"},
        "prompt_only": {"prompt": q, "answer": a},
    }[fmt]


def jsonl(fmt: str, bad: dict[int, bytes], n: int = GOOD, eol: bytes = b"\n") -> bytes:
    """n lines of good records, with line k (1-based) replaced by bad[k] (appended past n when k > n)."""
    last = max([n, *bad])
    lines = [bad[k] if k in bad else json.dumps(good(fmt, k)).encode() for k in range(1, last + 1)]
    return eol.join(lines) + eol


def line_case(name: str, fmt: str, line: int, record, *expect: str, **kw) -> Case:
    """A JSONL file of good records with one bad record (a value, or raw bytes) at `line`."""
    raw = record if isinstance(record, bytes) else json.dumps(record).encode()
    return Case(name, f"{name}.jsonl", jsonl(fmt, {line: raw}), fmt, line, expect, **kw)


def with_value(fmt: str, key: str, value, i: int = 0) -> dict:
    return {**good(fmt, i), key: value}


def without(fmt: str, key: str, i: int = 0) -> dict:
    return {k: v for k, v in good(fmt, i).items() if k != key}


def chat(*turns) -> dict:
    return {"messages": list(turns)}


U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}


# ---------------------------------------------------------------- cases
def record_cases() -> list[Case]:
    """One bad record among good ones, for every format: wrong types, missing fields, bad messages."""
    c = line_case
    return [
        c("chat_content_number", "chat", 31, chat(U, {"role": "assistant", "content": 5}), "must be a string"),
        c(
            "chat_content_part_unknown",
            "chat",
            12,
            chat(U, {"role": "assistant", "content": [{"type": "audio", "audio": "x.wav"}]}),
            '"type": "image"',
        ),
        c(
            "chat_image_missing",
            "chat",
            16,
            chat({"role": "user", "content": [{"type": "image", "image": "nowhere.png"}]}, A),
            "does not exist",
        ),
        c("chat_images_without_markers", "chat", 17, {**chat(U, A), "images": ["a.png"]}, "1 image"),
        c("chat_role_unknown", "chat", 7, chat({"role": "robot", "content": "x"}, A), "unknown role"),
        c("chat_role_number", "chat", 8, chat({"role": 3, "content": "x"}, A), "role"),
        c("chat_messages_empty", "chat", 9, chat(), "empty"),
        c("chat_messages_string", "chat", 10, {"messages": "hello there"}, "list of messages"),
        c("chat_messages_null", "chat", 11, {"messages": None}, "null"),
        c("chat_messages_missing", "chat", 13, {"text": "no messages here"}, "messages"),
        c("chat_message_not_object", "chat", 14, chat("hi", A), "object"),
        c("chat_message_no_content", "chat", 15, chat({"role": "user"}, A), "content"),
        c("chat_no_assistant", "chat", 16, chat(U, U), "assistant"),
        c("chat_assistant_first", "chat", 17, chat(A, U, A), "assistant"),
        c(
            "chat_sharegpt_bad_from",
            "chat",
            18,
            {"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
            "role",
        ),
        c("chat_record_list", "chat", 5, [1, 2, 3], "object"),
        c("chat_record_number", "chat", 6, 42, "object"),
        c("chat_record_string", "chat", 19, "just text", "object"),
        c("chat_record_null", "chat", 20, None, "object"),
        c("chat_origin_reserved", "chat", 21, {**good("chat", 0), "_origin": "x"}, "reserved"),
        c(
            "chat_lone_surrogate",
            "chat",
            22,
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "c"}]}',
            "surrogate|UTF",
        ),
        c("instruction_output_missing", "instruction", 12, without("instruction", "output"), "output"),
        c("instruction_output_number", "instruction", 23, with_value("instruction", "output", 12), "text"),
        c("instruction_instruction_empty", "instruction", 24, with_value("instruction", "instruction", "  "), "empty"),
        c("instruction_input_list", "instruction", 25, with_value("instruction", "input", ["a"]), "text"),
        c("completion_text_list", "completion", 26, {"text": ["a", "b"]}, "text"),
        c("completion_text_empty", "completion", 27, {"text": ""}, "empty"),
        c("completion_text_missing", "completion", 28, {"body": "x"}, "text"),
        c("completion_text_nan", "completion", 29, b'{"text": NaN}', "NaN"),
        c(
            "prompt_completion_number",
            "prompt_completion",
            31,
            with_value("prompt_completion", "completion", 5),
            "text",
        ),
        c(
            "prompt_completion_null",
            "prompt_completion",
            32,
            with_value("prompt_completion", "completion", None),
            "null",
        ),
        c(
            "prompt_completion_dict",
            "prompt_completion",
            33,
            with_value("prompt_completion", "prompt", {"a": 1}),
            "text",
        ),
        c("preference_no_rejected", "preference", 8, without("preference", "rejected"), "rejected"),
        c("preference_rejected_number", "preference", 34, with_value("preference", "rejected", 1), "rejected"),
        c("preference_chosen_user_only", "preference", 35, with_value("preference", "chosen", [U]), "assistant"),
        c("preference_prompt_empty", "preference", 36, with_value("preference", "prompt", ""), "empty"),
        c(
            "prompt_only_prompt_number",
            "prompt_only",
            37,
            with_value("prompt_only", "prompt", 7),
            "list of messages|number",
        ),
        c("prompt_only_prompt_empty_list", "prompt_only", 38, with_value("prompt_only", "prompt", []), "empty"),
        c(
            "chat_column_mapping_missing",
            "chat",
            1,
            {"dialog": [U, A]},
            "convo",
            source={"columns": {"messages": "convo"}},
        ),
    ]


def deep(n: int, opener: str = "[", closer: str = "]") -> bytes:
    return (opener * n + closer * n).encode()


def syntax_cases() -> list[Case]:
    """Lines that are not JSON records: truncated, garbage, NUL, bad encodings, BOMs, deep nesting."""
    c = line_case
    deep_obj = ('{"a":' * 100_000 + "1" + "}" * 100_000).encode()
    return [
        c("json_truncated", "chat", 7, b'{"messages": [{"role": "user", "content": "hi"', "JSON"),
        c("json_trailing_garbage", "chat", 3, json.dumps(good("chat", 0)).encode() + b" xyz", "JSON"),
        c("json_single_quotes", "chat", 4, b"{'messages': []}", "JSON"),
        c("json_nul_raw", "completion", 3, b'{"text": "a\x00b"}', "JSON|NUL"),
        c("json_nul_outside", "completion", 5, b'\x00{"text": "a"}', "JSON|NUL|binary"),
        c("json_latin1", "completion", 4, '{"text": "caf\xe9"}'.encode("latin-1"), "UTF-8"),
        c("json_bom_mid_file", "completion", 3, b'\xef\xbb\xbf{"text": "x"}', "BOM|JSON"),
        c("json_deep_list", "chat", 2, deep(100_000), "deep|nest"),
        c("json_deep_object", "chat", 6, deep_obj, "deep|nest"),
        c("json_deep_in_field", "chat", 9, b'{"messages": ' + deep(5000) + b"}", "deep|nest"),
        c("json_moderately_deep", "chat", 10, b'{"messages": ' + deep(300) + b"}", "deep|nest|message"),
        c("json_huge_line", "completion", 3, b'{"text": "' + b"x" * (50 << 20) + b'"}', "MiB|MB|limit"),
        c("json_unterminated_huge", "completion", 2, b'{"text": "' + b"y" * (2 << 20), "JSON"),
        Case("json_crlf_bad_line", "crlf.jsonl", jsonl("chat", {12: b"{broken"}, eol=b"\r\n"), "chat", 12, ("JSON",)),
        Case(
            "json_blank_lines_before_bad", "blank.jsonl", b"\n\n" + jsonl("chat", {8: b"[nope"}), "chat", 10, ("JSON",)
        ),
    ]


def _csv(rows: list[list[str]]) -> bytes:
    return "".join(",".join(r) + "\n" for r in rows).encode()


def _parquet(records: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def file_cases() -> list[Case]:
    """Whole files that are wrong: empty, binary, compressed, UTF-16, CSV, JSON lists, parquet, text."""
    rng = random.Random(7)
    binary = bytes(rng.randrange(256) for _ in range(4096))
    body = jsonl("chat", {})
    header = ["prompt", "completion"]
    rows = [header] + [[f"q{i}", f"a{i}"] for i in range(10)]
    return [
        Case("empty_file", "empty.jsonl", b"", line=None, expect=("no records|empty",)),
        Case("whitespace_file", "blank.jsonl", b"  \n\n\t\n", expect=("no records|empty",)),
        Case("binary_jsonl", "random.jsonl", binary, expect=("binary|UTF-8",)),
        Case("gzip_named_jsonl", "packed.jsonl", gzip.compress(body, mtime=0), expect=("gzip",)),
        Case("zip_named_jsonl", "packed2.jsonl", b"PK\x03\x04" + binary[:200], expect=("zip",)),
        Case("utf16_jsonl", "wide.jsonl", body.decode().encode("utf-16"), expect=("UTF-16",)),
        Case("utf16_no_bom_jsonl", "wide2.jsonl", body.decode().encode("utf-16-le"), expect=("UTF-16",)),
        Case("parquet_named_jsonl", "table.jsonl", _parquet([good("chat", 1)]), expect=("parquet",)),
        Case(
            "csv_ragged",
            "ragged.csv",
            _csv(rows[:5] + [["q", "a", "extra"]] + rows[5:]),
            "prompt_completion",
            5,
            ("values",),
        ),
        Case("csv_short_row", "short.csv", _csv(rows[:3] + [["only"]] + rows[3:]), "prompt_completion", 3, ("values",)),
        Case(
            "csv_duplicate_header",
            "dup.csv",
            _csv([["prompt", "prompt"]] + rows[1:]),
            "prompt_completion",
            None,
            ("repeats",),
        ),
        Case(
            "csv_empty_header", "nohead.csv", _csv([["prompt", ""]] + rows[1:]), "prompt_completion", None, ("no name",)
        ),
        Case("csv_header_only", "head.csv", _csv([header]), "prompt_completion", None, ("no records",)),
        Case(
            "csv_latin1",
            "latin.csv",
            "prompt,completion\nq,caf\xe9\n".encode("latin-1"),
            "prompt_completion",
            2,
            ("UTF-8",),
        ),
        Case("csv_nul", "nul.csv", b"prompt,completion\nq1,a1\nq\x002,a2\n", "prompt_completion", 2, ("NUL",)),
        Case(
            "csv_unclosed_quote",
            "quote.csv",
            b'prompt,completion\nq1,a1\nq2,"a2\nq3,a3\n',
            "prompt_completion",
            3,
            ("quot",),
        ),
        Case("csv_bad_messages_json", "msgs.csv", b'messages\n"[{""role"": ""user"""\n', "chat", 1, ("JSON",)),
        Case("json_list_missing_comma", "list.json", b'[\n{"text": "a"}\n{"text": "b"}\n]', "completion", 3, ("JSON",)),
        Case("json_list_of_numbers", "nums.json", b"[1, 2, 3]", "completion", 1, ("object",)),
        Case("json_list_deep", "deep.json", b"[" + deep(100_000) + b"]", "completion", 1, ("deep|nest",)),
        Case("json_list_unclosed", "open.json", b'[{"text": "a"},\n{"text": "b"}', "completion", 2, ("JSON",)),
        Case("parquet_not_parquet", "fake.parquet", b"this is not parquet\n", "completion", None, ("parquet",)),
        Case(
            "parquet_truncated",
            "cut.parquet",
            _parquet([good("completion", i) for i in range(20)])[:300],
            "completion",
            None,
            ("parquet",),
        ),
        Case(
            "parquet_wrong_type", "types.parquet", _parquet([{"text": i} for i in range(5)]), "completion", 1, ("text",)
        ),
        Case("txt_latin1", "notes.txt", "ok\ncaf\xe9\n".encode("latin-1"), "completion", 2, ("UTF-8",)),
        Case("txt_binary", "blob.txt", binary, "completion", None, ("binary|UTF-8",)),
    ]


def path_cases() -> list[Case]:
    """Paths that are not regular readable data files."""
    return [
        Case("fifo", "pipe.jsonl", kind="fifo", expect=("FIFO|pipe",)),
        Case("directory_named_jsonl", "folder.jsonl", kind="dir", expect=("folder|director",)),
        Case("symlink_loop", "loop.jsonl", kind="loop", expect=("loop|symbolic",)),
        Case("dangling_symlink", "dangling.jsonl", kind="dangling", expect=("link|not exist|not found",)),
        Case("unreadable", "secret.jsonl", jsonl("chat", {}), kind="unreadable", expect=("permission|read",)),
        Case("missing_file", "absent.jsonl", kind="missing", expect=("not found|no such",)),
        Case("unsupported_extension", "sheet.xlsx", b"PK\x03\x04", expect=("unsupported|xlsx",)),
        Case("glob_no_match", "x.jsonl", b"", path="nothing-*.jsonl", expect=("match",)),
    ]


def skip_cases() -> list[Case]:
    """data.skip_bad_records: bad records are counted and named; a source with nothing usable is an error."""
    skip = {"skip_bad_records": True}
    mixed = jsonl(
        "chat",
        {
            3: b"{broken",
            31: json.dumps(chat(U, {"role": "assistant", "content": 5})).encode(),
            33: json.dumps(chat(U, U)).encode(),
        },
    )
    return [
        Case("skip_some_bad", "some.jsonl", mixed, "chat", 3, (r"skip",), data=skip, ok=True),
        Case("skip_all_unparsable", "all.jsonl", b"{x\n{y\n{z\n", "chat", 1, ("no usable|bad",), data=skip),
        Case(
            "skip_all_unnormalizable",
            "nouse.jsonl",
            b"\n".join(json.dumps(chat(U, U)).encode() for _ in range(5)) + b"\n",
            "chat",
            1,
            ("no usable|assistant",),
            data=skip,
        ),
        Case(
            "skip_all_wrong_type",
            "wrong.jsonl",
            b"\n".join(json.dumps({"text": i}).encode() for i in range(5)) + b"\n",
            "completion",
            1,
            ("no usable|text",),
            data=skip,
        ),
    ]


def long_cases() -> list[Case]:
    """Valid but long records: prepared (truncated or dropped per data.overlong) in bounded time."""
    turns = [
        m
        for i in range(2000)
        for m in ({"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"})
    ]
    long_conv = json.dumps({"messages": turns}).encode()
    big_text = json.dumps({"text": "word " * 400_000}).encode()  # 2 MB, under the line limit
    return [
        Case("bom_first_line", "bom.jsonl", b"\xef\xbb\xbf" + jsonl("chat", {}), ok=True),
        Case("long_conversation", "long.jsonl", jsonl("chat", {3: long_conv}), ok=True),
        Case(
            "long_conversation_drop",
            "longdrop.jsonl",
            jsonl("chat", {3: long_conv}),
            ok=True,
            data={"overlong": "drop"},
        ),
        Case(
            "long_conversation_last",
            "longlast.jsonl",
            jsonl("chat", {3: long_conv}),
            ok=True,
            data={"train_on": "last_assistant"},
        ),
        Case("long_text", "longtext.jsonl", jsonl("completion", {2: big_text}), "completion", ok=True),
        Case(
            "long_assistant_message",
            "longmsg.jsonl",
            jsonl("chat", {2: json.dumps(chat(U, {"role": "assistant", "content": "w " * 1_000_000})).encode()}),
            ok=True,
        ),
    ]


def cases() -> list[Case]:
    """Every case, in a fixed order."""
    out = record_cases() + syntax_cases() + file_cases() + path_cases() + skip_cases() + long_cases()
    names = [c.name for c in out]
    assert len(names) == len(set(names)), "case names must be unique"
    return out


def materialize(case: Case, folder: Path) -> str:
    """Write the case's file into `folder`; return the path for data.datasets[0].path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / case.file
    if case.kind == "file":
        path.write_bytes(case.body)
    elif case.kind == "fifo":
        os.mkfifo(path)
    elif case.kind == "dir":
        path.mkdir()
    elif case.kind == "loop":
        os.symlink(folder / "loop2.jsonl", path)
        os.symlink(path, folder / "loop2.jsonl")
    elif case.kind == "dangling":
        os.symlink(folder / "gone.jsonl", path)
    elif case.kind == "unreadable":
        path.write_bytes(case.body)
        path.chmod(0)
    return str(folder / case.path) if case.path else str(path)
