"""YAML + `--set` overrides + `${ENV}` expansion -> a validated, frozen `Config`.

Every problem is collected (YAML syntax, unknown keys, wrong types, missing environment variables,
bad overrides, conflicting choices) and raised together as one `ConfigError`, each naming the dotted
key and where it was written: `file.yaml:LINE` or the `--set` argument.

Files and `--set` values are read under limits (size, encoding, characters, nesting, aliases, tags:
`finetune.config.yaml_safe`). `${VAR}` expansion (`finetune.config.env`) records which keys read the
environment; the returned Config keeps that record (`Config.env_references()`, `Config.env_variables()`) so
that redaction can write the secrets among them back as references.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from finetune.config import yaml_safe
from finetune.config.checks import check
from finetune.config.env import Expansion
from finetune.config.errors import translate
from finetune.config.schema import Config
from finetune.errors import ConfigError, Problem, clip, dotted

MAX_SET_PARTS = 16  # dotted parts of a --set key


@dataclass
class Source:
    """Where each key path was written, for error messages."""

    name: str
    lines: dict[tuple, int] = field(default_factory=dict)
    overrides: dict[tuple, str] = field(default_factory=dict)

    def where(self, path: tuple) -> str:
        if path not in self.lines:  # a key that only a --set wrote
            for written, item in self.overrides.items():
                if written[: len(path)] == path:
                    return f"--set {item}"
        for n in range(len(path), -1, -1):
            prefix = tuple(path[:n])
            if prefix in self.overrides:
                return f"--set {self.overrides[prefix]}"
            if prefix in self.lines:
                return f"{self.name}:{self.lines[prefix]}"
        return self.name


def load(path: str | os.PathLike, overrides: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> Config:
    """Read a job file, apply `--set key.path=value` overrides, expand `${VAR}`, validate."""
    return loads(yaml_safe.read_text(path), name=str(path), overrides=overrides, environ=environ)


def loads(
    text: str, name: str = "<string>", overrides: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> Config:
    """Like `load`, for YAML text already in memory."""
    environ = os.environ if environ is None else environ
    source = Source(name=name)
    problems: list[Problem] = []
    data = _parse_yaml(text, source, problems)
    if data is None:
        raise ConfigError(source.name, _locate(problems, source))
    expansion = Expansion(environ, lambda value: yaml_safe.parse_value(value, "${...}"), problems)
    data = expansion.value(data)
    for item in overrides:
        _apply_override(data, item, source, problems)
    config = _validate(data, source, problems)
    kept = [p for p in expansion.references if not _overridden(p, source)]
    config._env_references = {p: expansion.references[p] for p in kept}
    config._env_variables = {name: value for p in kept for name, value in expansion.used[p].items()}
    return config


def _overridden(path: tuple, source: Source) -> bool:
    """True when a --set replaced this path or a section holding it."""
    return any(path[: len(o)] == o for o in source.overrides)


# ---------------------------------------------------------------- YAML with line numbers
def _parse_yaml(text: str, source: Source, problems: list[Problem]) -> dict | None:
    data, found = yaml_safe.parse(text, source.name, source.lines)
    problems.extend(found)
    if data is None and not found:
        problems.append(Problem((), "the file is empty", "start from examples/yaml/quickstart.yaml", (source.name,)))
        return None
    if data is not None and not isinstance(data, dict):
        problems.append(
            Problem(
                (),
                "the top level must be a mapping of sections (model:, data:, method:, ...)",
                "",
                (f"{source.name}:{source.lines.get((), 1)}",),
            )
        )
        return None
    return data


# ---------------------------------------------------------------- --set overrides
def _apply_override(data: dict, item: str, source: Source, problems: list[Problem]) -> None:
    key, sep, raw = item.partition("=")
    shown = clip(item)

    def refuse(keys: tuple, message: str, fix: str) -> None:
        problems.append(Problem(keys, message, fix, (f"--set {shown}",)))

    if not sep or not key.strip():
        return refuse(
            (),
            f"--set {clip(item)!r} is not KEY=VALUE",
            "write it as --set train.lr=1e-4 (dotted key, '=', YAML value)",
        )
    parts = key.strip().split(".")
    if len(parts) > MAX_SET_PARTS:
        return refuse(
            (),
            f"--set key has {len(parts)} dotted parts; no key of a job file is deeper than a few",
            "check the dotted key (ft explain lists the keys)",
        )
    path = tuple(int(p) if p.isascii() and p.isdigit() and len(p) < 10 else p for p in parts)
    try:
        value = yaml_safe.parse_value(raw, f"--set {key}") if raw.strip() else ""
    except ValueError as e:
        return refuse(
            (path,),
            f"value {clip(raw)!r} is not valid YAML here ({e})",
            "quote it, e.g. --set 'model.name=\"org/model\"'",
        )
    target: Any = data
    for i, part in enumerate(path):
        here = path[: i + 1]
        if isinstance(target, list) and not (isinstance(part, int) and part < len(target)):
            return refuse(
                (here,),
                f"--set {clip(key)}: index {part} is out of range ({dotted(path[:i])} has {len(target)} items)",
                "use an index that exists",
            )
        if not isinstance(target, (dict, list)):
            return refuse(
                (path[:i],),
                f"--set {clip(key)}: {dotted(path[:i])} is not a section or list, so it has no key {clip(repr(part))}",
                "check the dotted key (ft explain lists the keys)",
            )
        if i == len(path) - 1:
            break
        if isinstance(target, dict) and target.get(part) is None:
            target[part] = {}  # a section that is absent or written empty ("train:")
        target = target[part]
    target[path[-1]] = value
    source.overrides[path] = shown


# ---------------------------------------------------------------- validation
def _validate(data: dict, source: Source, problems: list[Problem]) -> Config:
    """Validate; keys that already have a problem (a missing env var, a bad --set) are not reported twice."""
    try:
        config = Config.model_validate(data)
    except ValidationError as e:
        seen = {k for p in problems for k in p.keys}
        problems.extend(p for p in translate(e.errors(include_url=False)) if not set(p.keys) & seen)
        valid = _valid_sections(data)
        problems.extend(check(Config.model_construct(**valid), set(valid)))
    else:
        problems.extend(check(config))
        if not problems:
            return config
    raise ConfigError(source.name, _locate(problems, source))


def _valid_sections(data: dict) -> dict:
    """The top-level sections that validate on their own (or are absent and have a default)."""
    out = {}
    for name, f in Config.model_fields.items():
        if name not in data:
            if not f.is_required():
                out[name] = f.get_default()
            continue
        try:
            out[name] = TypeAdapter(f.annotation).validate_python(data[name])
        except ValidationError:
            pass
    return out


def _locate(problems: list[Problem], source: Source) -> list[Problem]:
    out = []
    for p in problems:
        where = p.where or tuple(source.where(k) for k in p.keys) or (source.name,)
        out.append(Problem(p.keys, p.message, p.fix, where))
    return out
