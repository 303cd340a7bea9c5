"""Where `ft generate` keeps its results: part files while it runs, one output file when it is done.

OUT.parts/, next to the output file OUT, holds:
    job.json          the settings; a restart must use the same ones (or --overwrite)
    plan-A.json       attempt A's batches, those still to do, and the prompts already done inside them
    part-A-rR.jsonl   what process R of attempt A finished: one line per prompt, {"id", "tokens", "row"},
                      appended and flushed batch by batch
    stats-A-rR.json   that process's rows, tokens, and start and end of its generation
A line counts once it ends with a newline: a line cut short by a kill is ignored, and its prompt is
generated again. The merge takes OUT's rows (from an earlier, complete run) and every part's, keeps the
first row of each id, writes OUT in input order through a temporary file, and removes OUT.parts. Rows
are copied as the text the worker wrote, so the output does not depend on who wrote which part.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError

_PART = re.compile(r"part-(\d+)-r(\d+)\.jsonl")


def parts_dir(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def id_key(value) -> str:
    """Ids compared as their JSON text: 7 and "7" are different ids."""
    return json.dumps(value, sort_keys=True, default=str)


def row_text(fields: dict, id_field: str, id_, output_field: str, completion: str) -> str:
    """One output line (without the newline): the input's fields, its id, and the completion."""
    row = dict(fields)
    row.setdefault(id_field, id_)
    row[output_field] = completion
    return json.dumps(row, ensure_ascii=False, default=str)


def complete_lines(path: Path):
    """(line number, text) of the lines that end with a newline; a last line cut short is left out."""
    with open(path, encoding="utf-8", newline="") as f:
        for number, line in enumerate(f, 1):
            if line.endswith("\n") and line.strip():
                yield number, line[:-1]


def next_attempt(folder: Path) -> int:
    found = [int(m.group(1)) for p in folder.glob("part-*.jsonl") if (m := _PART.fullmatch(p.name))]
    plans = [int(p.stem.split("-")[1]) for p in folder.glob("plan-*.json") if p.stem.split("-")[1].isdigit()]
    return max(found + plans, default=0) + 1


def done_rows(out: Path, id_field: str, known: set[str]) -> dict[str, str]:
    """id key -> row text of every prompt already generated: OUT's rows, then the parts'."""
    rows: dict[str, str] = {}
    if out.is_file():
        for number, line in complete_lines(out):
            key = id_key(_parse(out, number, line).get(id_field))
            if key not in known:
                raise FtError(
                    f"{out}:{number}: a row with {id_field} {json.loads(key)!r}, which is not among the prompts: {out} "
                    "was written for other prompts.\n    fix: pass --overwrite to replace it, or choose another --out"
                )
            rows.setdefault(key, line)
    folder = parts_dir(out)
    for part in sorted(folder.glob("part-*.jsonl")) if folder.is_dir() else ():
        for number, line in complete_lines(part):
            record = _parse(part, number, line)
            rows.setdefault(id_key(record["id"]), record["row"])
    return rows


def _parse(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise FtError(
            f"{path}:{number}: not a JSON record ({e.msg}).\n    fix: delete that line (its prompt is generated again)"
        ) from None
    if not isinstance(record, dict):
        raise FtError(f"{path}:{number}: not a JSON object.\n    fix: delete that line (its prompt is generated again)")
    return record


class PartWriter:
    """Appends one process's finished prompts to its part file, a batch at a time."""

    def __init__(self, folder: Path, attempt: int, rank: int):
        self.path = folder / f"part-{attempt}-r{rank}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, items: list[tuple[object, int, str]]) -> None:
        """(id, generated tokens, row text) per prompt; on disk before this returns."""
        self._file.write(
            "".join(
                json.dumps({"id": i, "tokens": n, "row": row}, ensure_ascii=False, default=str) + "\n"
                for i, n, row in items
            )
        )
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class PartsWatcher:
    """Counts the rows and tokens that one attempt's processes have written so far (for the progress bar)."""

    def __init__(self, folder: Path, attempt: int):
        self.folder, self.attempt = folder, attempt
        self._offsets: dict[Path, int] = {}
        self.rows = self.tokens = 0

    def poll(self) -> tuple[int, int]:
        for path in self.folder.glob(f"part-{self.attempt}-r*.jsonl"):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                if line.strip():
                    self.rows += 1
                    self.tokens += int(json.loads(line).get("tokens", 0))
        return self.rows, self.tokens


@dataclass(frozen=True)
class Stats:
    rows: int
    tokens: int
    seconds: float  # from the first process starting to generate to the last one finishing
    processes: int = 0  # that wrote their stats: every process of the attempt, on every node


def write_stats(folder: Path, attempt: int, rank: int, rows: int, tokens: int, start: float, end: float) -> None:
    (folder / f"stats-{attempt}-r{rank}.json").write_text(
        json.dumps({"rows": rows, "tokens": tokens, "start": start, "end": end})
    )


def read_stats(folder: Path, attempt: int) -> Stats:
    found = [json.loads(p.read_text()) for p in folder.glob(f"stats-{attempt}-r*.json")]
    if not found:
        return Stats(0, 0, 0.0)
    seconds = max(s["end"] for s in found) - min(s["start"] for s in found)
    return Stats(sum(s["rows"] for s in found), sum(s["tokens"] for s in found), seconds, len(found))


def merge(out: Path, keys: list[str], id_field: str) -> int:
    """Write OUT with one row per key, in the order of `keys`; remove the parts. Returns the rows written."""
    rows = done_rows(out, id_field, set(keys))
    missing = [k for k in keys if k not in rows]
    if missing:
        raise FtError(
            f"{len(missing)} prompts have no output yet (first: {id_field} {json.loads(missing[0])!r}).\n"
            "    fix: run the same command again: it generates only what is missing"
        )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(rows[k] + "\n" for k in keys))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    shutil.rmtree(parts_dir(out), ignore_errors=True)
    return len(keys)
