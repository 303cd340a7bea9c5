"""`${VAR}` and `${VAR:-default}` in job files; defaults may hold references themselves: `${A:-${B:-x}}`.

The expansion remembers which key paths took text from the environment, what was written there and which
variables each read, so that whatever ft writes out (the run folder's config.yaml, the model card, trackers)
records the values and shows a secret as its `${VAR}` (finetune/redaction.py): secrets passed through the
environment never reach a file.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from finetune.errors import Problem

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_NESTING = 8
MAX_EXPANDED = 4 << 20  # characters produced by expansion over the whole file


@dataclass
class Expansion:
    """State of one file's expansion: the environment, what it gave, and the problems found."""

    environ: Mapping[str, str]
    parse: Callable[[str], Any]  # reads an expanded whole-value reference as YAML (`${STEPS}` -> 100)
    problems: list[Problem] = field(default_factory=list)
    # key path -> text as written, for paths that read the environment
    references: dict[tuple, str] = field(default_factory=dict)
    used: dict[tuple, dict[str, str]] = field(default_factory=dict)  # key path -> {variable: value} it read
    produced: int = 0

    def value(self, value: Any, path: tuple = ()) -> Any:
        """`value` with every reference in its strings expanded (dicts and lists are copied)."""
        if isinstance(value, dict):
            return {k: self.value(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, path + (i,)) for i, v in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        return self._string(value, path)

    def _string(self, text: str, path: tuple) -> Any:
        missing: list[str] = []
        used: list[str] = []
        scan = _Scan(text, _pairs(text), missing, used, path)
        expanded, whole = self._expand(scan, 0, len(text), 0)
        if missing:
            name = missing[0]
            self.problems.append(
                Problem(
                    (path,),
                    f"environment variable {name} is not set",
                    f"export {name}=... before running, or write ${{{name}:-default}} to give a default",
                )
            )
            return text
        self.produced += len(expanded)
        if self.produced > MAX_EXPANDED:
            self.problems.append(
                Problem(
                    (path,),
                    f"${{...}} references expand to more than {MAX_EXPANDED >> 20} MiB of text",
                    "check the environment variables this file uses",
                )
            )
            return text
        if used:
            self.references[path] = text
            self.used[path] = {name: self.environ[name] for name in used}
        if whole and expanded != text:
            try:
                return self.parse(expanded)
            except ValueError:
                return expanded
        return expanded

    def _expand(self, scan: _Scan, lo: int, hi: int, depth: int) -> tuple[str, bool]:
        """(expansion of text[lo:hi], whether that text is exactly one reference)."""
        text, out = scan.text, []
        i, refs = lo, 0
        while True:
            j = text.find("${", i, hi)
            if j < 0:
                out.append(text[i:hi])
                break
            out.append(text[i:j])
            ref = self._reference(scan, j, depth)
            if ref is None:  # not a reference: kept as written
                out.append("${")
                i = j + 2
                continue
            value, i = ref
            out.append(value)
            refs += 1
        return "".join(out), refs == 1 and text.startswith("${", lo) and i == hi

    def _reference(self, scan: _Scan, start: int, depth: int):
        """(value, index after the reference) for the reference at `start`, or None when there is none."""
        text = scan.text
        m = _NAME.match(text, start + 2)
        if m is None:
            return None
        name, k = m.group(), m.end()
        if text.startswith("}", k):
            return self._lookup(scan, name), k + 1
        end = scan.pairs.get(start)
        if not text.startswith(":-", k) or end is None:
            return None
        if name in self.environ:
            return self._lookup(scan, name), end + 1
        if depth >= MAX_NESTING:
            self.problems.append(
                Problem(
                    (scan.path,),
                    f"${{...}} defaults nested more than {MAX_NESTING} levels deep",
                    "simplify the default",
                )
            )
            return "", end + 1
        value, _ = self._expand(scan, k + 2, end, depth + 1)
        return value, end + 1

    def _lookup(self, scan: _Scan, name: str) -> str:
        if name in self.environ:
            scan.used.append(name)
            return self.environ[name]
        scan.missing.append(name)
        return ""


@dataclass
class _Scan:
    """One string being expanded."""

    text: str
    pairs: dict[int, int]
    missing: list[str]
    used: list[str]
    path: tuple


def _pairs(text: str) -> dict[int, int]:
    """Index of each `${` -> index of the `}` closing it (the innermost open `${` is closed first)."""
    pairs: dict[int, int] = {}
    open_: list[int] = []
    for m in re.finditer(r"\$\{|\}", text):
        if m.group() == "}":
            if open_:
                pairs[open_.pop()] = m.start()
        else:
            open_.append(m.start())
    return pairs
