"""Reading YAML under limits, so that no job file can exhaust memory, time or the stack, or run code.

PyYAML turns a document into whatever it describes: an alias repeats a whole collection, so nine levels
of nine aliases describe 387 million values; each level of nesting is one level of recursion; and tags
can ask for Python objects. Here the event stream is read directly and turned into plain dicts, lists,
strings, numbers, booleans and None, with an explicit stack (no recursion), while counting:

- the size of the file (`MAX_BYTES`), its encoding (UTF-8) and its characters (no NUL or other control
  characters, the same set YAML itself forbids);
- nesting depth (`MAX_DEPTH`) and values built, aliases included (`MAX_VALUES`);
- the length of numbers (`MAX_NUMBER_CHARS`), so that a 100,000-digit integer is never converted;
- tags: only the standard scalar and collection tags are accepted.

Problems name the file and line. Key paths and lines go into `lines`, for the loader's messages.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    CollectionStartEvent,
    DocumentStartEvent,
    MappingStartEvent,
    ScalarEvent,
)
from yaml.nodes import ScalarNode

from finetune.errors import FtError, Problem

MAX_BYTES = 1 << 20
MAX_DEPTH = 64
MAX_VALUES = 100_000
MAX_NUMBER_CHARS = 64
_STD = "tag:yaml.org,2002:"
ALLOWED_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null", "seq", "map")}
_SCALARS = {_STD + t for t in ("str", "int", "float", "bool", "null", "timestamp")}
# What YAML does not allow in a stream (YAML 1.1 "printable" characters, as PyYAML checks them).
NON_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = yaml.resolver.Resolver()
_CONSTRUCTOR = yaml.constructor.SafeConstructor()


class Fatal(Exception):
    """Reading stops: the problem is in `problem`."""

    def __init__(self, problem: Problem):
        super().__init__(problem.message)
        self.problem = problem


def read_text(path: str | Path) -> str:
    """The text of a job file: at most MAX_BYTES, UTF-8 (a BOM is dropped); otherwise an FtError naming the file."""
    p = Path(path)
    if not p.is_file():
        hint = " (it is a folder)" if p.is_dir() else (" (it is not a regular file)" if p.exists() else "")
        raise FtError(
            f"config file not found: {path}{hint}. Pass the path of a job YAML, e.g. examples/yaml/quickstart.yaml"
        )
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise FtError(f"{path}: cannot be read ({e.strerror or e}).\n    fix: check the file's permissions") from None
    if len(data) > MAX_BYTES:
        raise FtError(
            f"{path}: the job file is larger than {MAX_BYTES // 2**20} MiB; a job file holds settings, not data.\n"
            "    fix: keep data in the files data.datasets points to"
        )
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = e.start + bom
        line = data[:at].count(b"\n") + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise FtError(
            f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); is it a YAML file?\n"
            "    fix: save the file as UTF-8"
        ) from None


def bad_character(text: str, name: str) -> Problem | None:
    """A Problem for the first character YAML forbids (NUL and other control characters), or None."""
    m = NON_PRINTABLE.search(text)
    if m is None:
        return None
    line = text.count("\n", 0, m.start()) + 1
    column = m.start() - (text.rfind("\n", 0, m.start()) + 1) + 1
    char = m.group()
    what = "NUL" if char == "\0" else f"U+{ord(char):04X}"
    return Problem(
        (),
        f"control character {what} is not allowed in a job file",
        'remove it; write special characters as escapes inside double quotes ("\\t")',
        (f"{name}:{line}:{column}",),
    )


def parse(text: str, name: str, lines: dict[tuple, int] | None = None) -> tuple[Any, list[Problem]]:
    """Text -> (plain data, problems). Data is None after a problem that stops reading (it is then last)."""
    text = str(text)  # a str subclass as plain text: libyaml's parser takes nothing else
    if len(text) > MAX_BYTES:
        return None, [
            Problem(
                (),
                f"more than {MAX_BYTES // 2**20} MiB of YAML; a job file holds settings, not data",
                "keep data in the files data.datasets points to",
                (name,),
            )
        ]
    problem = bad_character(text, name)
    if problem:
        return None, [problem]
    builder = _Builder(name, {} if lines is None else lines)
    try:
        data = builder.run(yaml.parse(text, Loader=_LOADER))
    except Fatal as e:
        return None, builder.problems + [e.problem]
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark else name
        return None, builder.problems + [
            Problem(
                (),
                f"YAML syntax error: {e.problem or e.context}",
                "fix the syntax at that line (indentation, a missing ':' or an unclosed quote)",
                (where,),
            )
        ]
    except yaml.YAMLError as e:
        return None, builder.problems + [Problem((), f"YAML error: {e}", "fix the file", (name,))]
    return data, builder.problems


def parse_value(text: str, name: str) -> Any:
    """One YAML value (a `--set` value, an expanded `${VAR}`); ValueError with the first problem's text."""
    data, problems = parse(text, name)
    if problems:
        raise ValueError(problems[0].message)
    return data


@dataclass
class _Frame:
    """A collection being built."""

    path: tuple | None  # None: the value is dropped (a duplicate key) and its lines are not recorded
    value: Any
    line: int
    anchor: str | None
    start: int  # values counted before it began
    bad_tag: bool = False
    key: Any = None
    has_key: bool = False
    seen: dict = field(default_factory=dict)  # key -> line


_DROP = object()


class _Builder:
    """Turns parser events into plain data under the limits (see the module docstring)."""

    def __init__(self, name: str, lines: dict[tuple, int]):
        self.name, self.lines = name, lines
        self.problems: list[Problem] = []
        self.anchors: dict[str, tuple[Any, int]] = {}
        self.count = 0
        self.stack: list[_Frame] = []
        self.root: Any = _DROP
        self.documents = 0

    def run(self, events) -> Any:
        for event in events:
            if isinstance(event, DocumentStartEvent):
                self.documents += 1
                if self.documents > 1:
                    self._fatal(
                        event,
                        "the file holds more than one YAML document (a second '---')",
                        "keep one document per job file",
                    )
            elif isinstance(event, CollectionStartEvent):
                self._start(event)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                frame = self.stack.pop()
                value = None if frame.bad_tag else frame.value
                self._anchor(frame.anchor, value, self.count - frame.start)
                self._emit(value, frame.line)
            elif isinstance(event, ScalarEvent):
                self._scalar(event)
            elif isinstance(event, AliasEvent):
                self._alias(event)
        return None if self.root is _DROP else self.root

    # ------------------------------------------------------------ events
    def _start(self, event) -> None:
        if len(self.stack) >= MAX_DEPTH:
            self._fatal(
                event,
                f"nested more than {MAX_DEPTH} levels deep",
                "a job file needs a few levels; remove the extra nesting",
            )
        path = self._child_path()
        self._count(event, 1)
        bad = self._bad_tag(event, path)
        container: Any = {} if isinstance(event, MappingStartEvent) else []
        self.stack.append(_Frame(path, container, event.start_mark.line + 1, event.anchor, self.count - 1, bad))
        self._record(path, event)

    def _scalar(self, event: ScalarEvent) -> None:
        top = self.stack[-1] if self.stack else None
        self._count(event, 1)
        if top is not None and isinstance(top.value, dict) and not top.has_key:
            value: Any = event.value  # a key: its text as written
            if self._bad_tag(event, None):
                value = None
        else:
            path = self._child_path()
            self._record(path, event)
            value = None if self._bad_tag(event, path) else self._construct(event, path)
        self._anchor(event.anchor, value, 1)
        self._emit(value, event.start_mark.line + 1)

    def _alias(self, event: AliasEvent) -> None:
        if event.anchor not in self.anchors:
            self._fatal(
                event,
                f"alias *{event.anchor} refers to an anchor that is not defined before it (or to the collection "
                "it is in)",
                f"define &{event.anchor} before using it, outside the collection that uses it",
            )
        value, size = self.anchors[event.anchor]
        self._count(event, size)
        self._record(self._child_path(), event)
        self._emit(copy.deepcopy(value), event.start_mark.line + 1)

    # ------------------------------------------------------------ helpers
    def _count(self, event, n: int) -> None:
        self.count += n
        if self.count > MAX_VALUES:
            self._fatal(
                event,
                f"the file describes more than {MAX_VALUES:,} values (aliases expanded)",
                "a job file holds a few hundred values; remove the repeated aliases (*name) or the extra data",
            )

    def _anchor(self, anchor: str | None, value: Any, size: int) -> None:
        if anchor is not None:
            self.anchors[anchor] = (value, max(size, 1))

    def _child_path(self) -> tuple | None:
        if not self.stack:
            return ()
        top = self.stack[-1]
        if top.path is None:
            return None
        if isinstance(top.value, list):
            return top.path + (len(top.value),)
        return top.path + (top.key,) if top.has_key and top.key is not _DROP else None

    def _record(self, path: tuple | None, event) -> None:
        if path is not None and path not in self.lines:
            self.lines[path] = event.start_mark.line + 1

    def _emit(self, value: Any, line: int) -> None:
        if not self.stack:
            self.root = value
            return
        top = self.stack[-1]
        if isinstance(top.value, list):
            top.value.append(value)
        elif not top.has_key:
            top.key, top.has_key = self._key(top, value, line), True
        else:
            if top.key is not _DROP:
                top.value[top.key] = value
            top.has_key = False

    def _key(self, frame: _Frame, key: Any, line: int) -> Any:
        if not isinstance(key, str):
            where = (f"{self.name}:{line}",)
            self.problems.append(
                Problem(
                    (frame.path or (),),
                    "a key must be a plain name, not a list, a mapping or a null",
                    "write the key as text",
                    where,
                )
            )
            return _DROP
        if key in frame.seen:
            if frame.path is not None:
                self.problems.append(
                    Problem(
                        (frame.path + (key,),),
                        f"key written twice (first on line {frame.seen[key]})",
                        "keep only one of them",
                        (f"{self.name}:{line}",),
                    )
                )
            return _DROP
        frame.seen[key] = line
        if frame.path is not None:
            self.lines[frame.path + (key,)] = line
        return key

    def _bad_tag(self, event, path: tuple | None) -> bool:
        tag = event.tag
        if tag in (None, "!") or tag in ALLOWED_TAGS:
            return False
        shown = "!!" + tag[len(_STD) :] if tag.startswith(_STD) else tag
        self._value_problem(
            event,
            path,
            f"the tag {shown} is not allowed (it could build arbitrary objects)",
            "remove the tag: a job file holds plain text, numbers, booleans, lists and mappings",
        )
        return True

    def _construct(self, event: ScalarEvent, path: tuple | None) -> Any:
        tag = event.tag
        if tag in (None, "!"):
            tag = _RESOLVER.resolve(ScalarNode, event.value, event.implicit)
        if tag not in _SCALARS:
            return event.value  # `=` (the "value" tag) or `<<` (merge) as a value: plain text
        if tag in (_STD + "int", _STD + "float") and len(event.value) > MAX_NUMBER_CHARS:
            self._value_problem(
                event,
                path,
                f"a number written with {len(event.value):,} characters is not allowed",
                f"write a number of at most {MAX_NUMBER_CHARS} characters",
            )
            return None
        node = ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
        try:
            return _CONSTRUCTOR.yaml_constructors[tag](_CONSTRUCTOR, node)
        except (ValueError, TypeError, OverflowError, yaml.YAMLError):
            self._value_problem(
                event,
                path,
                f"{event.value[:40]!r} is not a valid {tag[len(_STD) :]}",
                "fix the value or remove the tag",
            )
            return None

    def _value_problem(self, event, path: tuple | None, message: str, fix: str) -> None:
        self.problems.append(
            Problem((path,) if path else (), message, fix, (f"{self.name}:{event.start_mark.line + 1}",))
        )

    def _fatal(self, event, message: str, fix: str) -> None:
        raise Fatal(Problem((), message, fix, (f"{self.name}:{event.start_mark.line + 1}",)))
