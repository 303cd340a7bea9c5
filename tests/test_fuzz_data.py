"""`ft preprocess` on bad data files (tests/fuzz/data_files.py): every case ends with exit code 2 and a
message naming the file (and the line, where the problem is in one), never a traceback, in bounded time.

Each case runs in a forked child of this process (the heavy imports are done once, before forking), so a
case that hangs is killed at its time limit and counted, instead of stopping the suite. A few cases also
run as real `python -m finetune preprocess` processes, to check what the user sees on the terminal.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from finetune.data.sources import load_source
from finetune.errors import DataError
from tests.fuzz.data_files import Case, cases, jsonl, materialize
from tests.helpers import REPO, spec

LIMIT_S = 20.0  # per case
CASES = cases()
BY_NAME = {c.name: c for c in CASES}
METHODS = {
    "preference": {"name": "dpo"},
    "prompt_only": {
        "name": "grpo",
        "max_new_tokens": 8,
        "rewards": [{"function": "exact_match", "args": {"column": "answer"}}],
    },
}

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(os, "mkfifo"), reason="needs fork and FIFOs (POSIX)"
)


@dataclass
class Outcome:
    """What running one case did: ok | error (an FtError) | crash (any other exception) | hang."""

    status: str
    message: str = ""
    exit_code: int | None = None
    seconds: float = 0.0
    output: str = ""


def job_file(case: Case, folder: Path) -> Path:
    """A job on ft-tiny that reads the case's file, with its cache and run folder under `folder`."""
    path = materialize(case, folder / "data")
    data = {
        "datasets": [{"path": path, "format": case.format, **case.source}],
        "seq_len": 64,
        "cache_dir": str(folder / "cache"),
        **case.data,
    }
    job = {
        "model": {"name": "ft-tiny"},
        "data": data,
        "method": METHODS.get(case.format, {"name": "sft"}),
        "output": {"dir": str(folder / "run")},
    }
    out = folder / "job.yaml"
    out.write_text(yaml.safe_dump(job, sort_keys=False))
    return out


def _child(config: Path, result: Path, log: Path) -> None:
    """Run `ft preprocess CONFIG` in this (forked) process; write the outcome as JSON; never return."""
    code = 0
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not pytest's capture: the file, as a terminal would
        logging.getLogger().handlers.clear()  # pytest's capture handler: warnings go to stderr, as in the CLI
        from finetune.errors import FtError
        from finetune.workflow import run_preprocess

        try:
            run_preprocess(config)
            outcome = {"status": "ok"}
        except FtError as e:
            outcome = {"status": "error", "message": str(e), "exit_code": e.exit_code}
        except BaseException as e:  # anything else is a crash: a traceback for the user
            outcome = {
                "status": "crash",
                "message": f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc()[-3000:],
            }
        result.write_text(json.dumps(outcome))
    except BaseException:
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_case(case: Case, folder: Path, limit: float = LIMIT_S) -> Outcome:
    """Run one case in a forked child, killed after `limit` seconds."""
    config, result, log = job_file(case, folder), folder / "result.json", folder / "output.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(config, result, log)
    while time.monotonic() - start < limit:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return Outcome("hang", seconds=time.monotonic() - start, output=_read(log))
    seconds = time.monotonic() - start
    if not result.is_file():
        return Outcome("crash", "the child died without a result", seconds=seconds, output=_read(log))
    return Outcome(**json.loads(result.read_text()), seconds=seconds, output=_read(log))


def _read(path: Path) -> str:
    return path.read_text(errors="replace")[-20000:] if path.is_file() else ""


def names_line(case: Case, text: str) -> bool:
    """True when `text` names the case's file with its line (or row)."""
    return re.search(rf"{re.escape(case.file)}:(row )?{case.line}\b", text) is not None


def problems(case: Case, out: Outcome) -> list[str]:
    """What is wrong with the outcome of a case (empty when it is right)."""
    found = []
    if out.status in ("crash", "hang"):
        return [f"{out.status} after {out.seconds:.1f}s: {out.message[:1500]}"]
    if out.seconds > LIMIT_S:
        found.append(f"took {out.seconds:.1f}s")
    if "Traceback (most recent call last)" in out.output:
        found.append("a traceback was printed")
    if case.ok:
        if out.status != "ok":
            return found + [f"valid data was refused: {out.message}"]
        if case.line and not names_line(case, out.output):
            found.append(f"the output does not name {case.file}:{case.line} among the skipped records")
        return found
    if out.status != "error" or out.exit_code != 2:
        return found + [f"expected an error with exit code 2, got {out.status} (exit code {out.exit_code})"]
    named = case.path or case.file
    if named not in out.message:
        found.append(f"the message does not name {named}")
    if case.line and not names_line(case, out.message):
        found.append(f"the message does not name line {case.line}")
    found += [f"the message does not match {p!r}" for p in case.expect if not re.search(p, out.message, re.I)]
    return found + ([] if re.search("fix|skip_bad_records", out.message, re.I) else ["the message says no fix"])


def warm_up(folder: Path) -> None:
    """Prepare good data once in this process, so that forked children start with every import done."""
    from finetune.workflow import run_preprocess

    run_preprocess(job_file(Case("warm_up", "good.jsonl", jsonl("chat", {}), ok=True), folder))


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    warm_up(tmp_path_factory.mktemp("warm"))


def test_there_are_enough_cases():
    assert len(CASES) >= 50
    assert sum(not c.ok for c in CASES) >= 50


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_bad_data_file(name, warm, tmp_path):
    case = BY_NAME[name]
    if case.kind == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads any file")
    out = run_case(case, tmp_path)
    assert not problems(case, out), (
        f"{name}: {problems(case, out)}\n--- message:\n{out.message}\n--- output:\n{out.output[-3000:]}"
    )


SUBPROCESS = ("json_deep_list", "fifo", "prompt_completion_number")


@pytest.mark.slow
def test_real_processes_print_one_error_and_exit_2():
    """A few cases through `python -m finetune preprocess`, in parallel: exit 2, `error: FILE:LINE`, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for name in SUBPROCESS:
            config = job_file(BY_NAME[name], Path(tmp) / name)
            runs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "finetune", "preprocess", str(config)],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for name, proc in zip(SUBPROCESS, runs):
            _, err = proc.communicate(timeout=120)
            case = BY_NAME[name]
            assert proc.returncode == 2, f"{name}: exit code {proc.returncode}\n{err[-3000:]}"
            assert "Traceback" not in err and err.lstrip().startswith("error: "), f"{name}:\n{err[-3000:]}"
            assert case.file in err and (case.line is None or names_line(case, err)), f"{name}:\n{err[-3000:]}"


# ---------------------------------------------------------------- long records: bounded, and the same result
def _conversations(rng):
    def words(n):
        return " ".join(rng.choice(["alpha", "be", "c", "delta!", "12", "\n", "x" * 30]) for _ in range(n))

    def turns(n, user, assistant):
        return [
            m
            for _ in range(n)
            for m in ({"role": "user", "content": words(user)}, {"role": "assistant", "content": words(assistant)})
        ]

    yield [{"role": "user", "content": words(5)}, {"role": "assistant", "content": words(1200)}]
    yield turns(120, 8, 8)
    yield turns(10, 2, 2)  # 20 short messages: within a long seq_len, nothing is cut
    yield [
        {"role": "system", "content": words(1200)},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
    yield [
        {"role": "user", "content": words(1200)},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "more"},
    ]
    yield turns(60, 20, 2) + [{"role": "user", "content": words(500)}]
    yield [{"role": "user", "content": "x" * 8000}, {"role": "assistant", "content": "y" * 10}]


@pytest.mark.slow
def test_long_records_give_what_the_whole_record_gives():
    """tokenize_record cuts long records before tokenizing; the kept tokens, labels and status must not change."""
    import random

    from finetune.config.schema import ModelSection
    from finetune.data import tokenize as tk
    from finetune.models import load_tokenizer
    from finetune.templates import resolve

    tokenizer = load_tokenizer(ModelSection(name="ft-tiny"))
    jinja = resolve(tokenizer, "tokenizer")
    rng = random.Random(0)
    checked = 0
    for seq_len in (16, 200):
        for train_on in ("assistant", "last_assistant", "all"):
            for overlong in ("truncate", "drop"):
                records = [("chat", {"messages": m}) for m in _conversations(rng)]
                records += [
                    ("completion", {"text": "word " * 2000}),
                    ("prompt_completion", {"prompt": "p " * 2000, "completion": "c " * 2000}),
                    ("prompt_completion", {"prompt": "short", "completion": "c " * 4000}),
                ]
                for fmt, record in records:
                    rules = tk.Rules(fmt, train_on, seq_len, overlong, seq_len)
                    fast = tk.fit_length(tk.tokenize_record(record, rules, tokenizer, jinja), rules)
                    assert fast == tk.fit_length(tk.tokenize_whole(record, rules, tokenizer, jinja), rules), (
                        fmt,
                        seq_len,
                        train_on,
                        overlong,
                    )
                    checked += 1
    assert checked == 2 * 3 * 2 * 10


def test_a_4000_message_conversation_is_tokenized_in_bounded_time():
    from finetune.config.schema import ModelSection
    from finetune.data import tokenize as tk
    from finetune.models import load_tokenizer
    from finetune.templates import resolve

    tokenizer = load_tokenizer(ModelSection(name="ft-tiny"))
    jinja = resolve(tokenizer, "tokenizer")
    turns = [
        m
        for i in range(2000)
        for m in ({"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"})
    ]
    rules = tk.Rules("chat", "assistant", 2048, "truncate", 2048)
    start = time.monotonic()
    row, status = tk.fit_length(tk.tokenize_record({"messages": turns}, rules, tokenizer, jinja), rules)
    assert status == "truncated" and len(row["input_ids"]) == 2048
    assert time.monotonic() - start < 10  # uncut: over a minute (masking renders every prefix)


# ---------------------------------------------------------------- the reader's checks, one by one
@pytest.mark.parametrize(
    "line, needle",
    [
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"text": ' + b"[" * 100 + b"]" * 100 + b"}", "nested too deeply"),
        (b'{"text": "a\\ud800"}', r"unpaired surrogate escape \(\\ud800\)"),
        (b'{"text": NaN}', "holds NaN, which JSON does not allow"),
        (b'\xef\xbb\xbf{"text": "a"}', "byte-order mark"),
        (b'{"text": "a\x00"}', "NUL byte"),
    ],
)
def test_records_ft_cannot_hold_name_their_line(tmp_path, line, needle):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' + line + b'\n{"text": "ok"}\n')
    with pytest.raises(DataError, match=rf"t.jsonl:2: .*{needle}"):
        load_source(spec(path, "completion"))
    _, stats = load_source(spec(path, "completion"), skip_bad_records=True)
    assert (stats.records_read, stats.records_skipped) == (2, 1)


def test_a_line_over_the_limit_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    from finetune.data import readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "' + b"x" * 5000 + b'"}\n{"text": "after"}\n')
    with pytest.raises(DataError, match=r"t.jsonl:2: the line is 4 KiB, over ft's limit of 1000 bytes"):
        load_source(spec(path, "completion"))
    ds, _ = load_source(spec(path, "completion"), skip_bad_records=True)
    assert ds["_origin"] == [f"{path}:1", f"{path}:3"]  # the long line is counted as one line


@pytest.mark.parametrize(
    "head, needle",
    [
        (b"\x1f\x8b\x08\x00", "gzip-compressed"),
        (b"PK\x03\x04", "zip archive"),
        (b"\xff\xfe{\x00", "UTF-16"),
        (b"PAR1", "a parquet file"),
        (bytes(range(256)) * 4, "looks binary"),
        ('{"text": "a"}'.encode("utf-16-le"), "UTF-16 text without"),
    ],
)
def test_files_that_are_not_text_are_named_with_the_fix(tmp_path, head, needle):
    path = tmp_path / "data.jsonl"
    path.write_bytes(head + b"rest")
    with pytest.raises(DataError, match=rf"{path}: the file .*{needle}.*\n    fix: "):
        load_source(spec(path, "completion"), skip_bad_records=True)


def test_paths_that_are_not_regular_files(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.jsonl")
    os.symlink(tmp_path / "b.jsonl", tmp_path / "a.jsonl")
    os.symlink(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    os.symlink(tmp_path / "gone.jsonl", tmp_path / "dangling.jsonl")
    for name, needle in (
        ("pipe.jsonl", "is a named pipe"),
        ("a.jsonl", "is a symbolic link that loops"),
        ("dangling.jsonl", "is a symbolic link to .*gone.jsonl, which does not exist"),
    ):
        with pytest.raises(DataError, match=rf"{name}: {needle}.*\n    fix: "):
            load_source(spec(tmp_path / name))
