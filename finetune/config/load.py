"""YAML + `--set` overrides + `${ENV}` expansion -> a validated, frozen `Config`.

Every problem is collected (YAML syntax, unknown keys, wrong types, missing environment variables,
bad overrides, conflicting choices) and raised together as one `ConfigError`, each naming the dotted
key and where it was written: `file.yaml:LINE` or the `--set` argument.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any, Iterable, Mapping

import yaml
from pydantic import TypeAdapter, ValidationError

from finetune.config.checks import check
from finetune.config.errors import translate
from finetune.config.schema import Config
from finetune.errors import ConfigError, FtError, Problem, dotted

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class Source:
    """Where each key path was written, for error messages."""

    name: str
    lines: dict[tuple, int] = field(default_factory=dict)
    overrides: dict[tuple, str] = field(default_factory=dict)

    def where(self, path: tuple) -> str:
        for n in range(len(path), -1, -1):
            prefix = tuple(path[:n])
            if prefix in self.overrides:
                return f"--set {self.overrides[prefix]}"
            if prefix in self.lines:
                return f"{self.name}:{self.lines[prefix]}"
        return self.name


def load(path: str | os.PathLike, overrides: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> Config:
    """Read a job file, apply `--set key.path=value` overrides, expand `${VAR}`, validate."""
    return loads(_read(path), name=str(path), overrides=overrides, environ=environ)


def loads(text: str, name: str = "<string>", overrides: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> Config:
    """Like `load`, for YAML text already in memory."""
    environ = os.environ if environ is None else environ
    source = Source(name=name)
    problems: list[Problem] = []
    data = _parse_yaml(text, source, problems)
    if data is None:
        raise ConfigError(source.name, _locate(problems, source))
    data = _expand_env(data, (), environ, problems)
    for item in overrides:
        _apply_override(data, item, source, problems)
    return _validate(data, source, problems)


def _read(path: str | os.PathLike) -> str:
    p = FsPath(path)
    if not p.is_file():
        hint = " (it is a folder)" if p.is_dir() else ""
        raise FtError(f"config file not found: {path}{hint}. Pass the path of a job YAML, e.g. examples/yaml/quickstart.yaml")
    return p.read_text(encoding="utf-8")


# ---------------------------------------------------------------- YAML with line numbers
def _parse_yaml(text: str, source: Source, problems: list[Problem]) -> dict | None:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        loc = f"{source.name}:{mark.line + 1}:{mark.column + 1}" if mark else source.name
        problems.append(Problem((), f"YAML syntax error: {e.problem}", "fix the syntax at that line (indentation, a missing ':' or an unclosed quote)", (loc,)))
        return None
    if node is None:
        problems.append(Problem((), "the file is empty", "start from examples/yaml/quickstart.yaml", (source.name,)))
        return None
    if not isinstance(node, yaml.MappingNode):
        problems.append(Problem((), "the top level must be a mapping of sections (model:, data:, method:, ...)", "", (f"{source.name}:{node.start_mark.line + 1}",)))
        return None
    return _build(node, (), source, problems)


def _build(node: yaml.Node, path: tuple, source: Source, problems: list[Problem]) -> Any:
    source.lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            if key in out:
                problems.append(Problem((path + (key,),), f"key written twice (first on line {source.lines[path + (key,)]})", "keep only one of them", (f"{source.name}:{key_node.start_mark.line + 1}",)))
                continue
            out[key] = _build(value_node, path + (key,), source, problems)
            source.lines[path + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, path + (i,), source, problems) for i, item in enumerate(node.value)]
    return yaml.SafeLoader(" ").construct_object(node)


# ---------------------------------------------------------------- ${ENV} expansion
def _expand_env(value: Any, path: tuple, environ: Mapping[str, str], problems: list[Problem]) -> Any:
    if isinstance(value, dict):
        return {k: _expand_env(v, path + (k,), environ, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, path + (i,), environ, problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        problems.append(Problem((path,), f"environment variable {name} is not set", f"export {name}=... before running, or write ${{{name}:-default}} to give a default"))
        return m.group(0)

    expanded = _ENV.sub(sub, value)
    # A value that was only "${VAR}" is read as YAML, so "${STEPS}" can give an integer.
    if _ENV.fullmatch(value) and expanded != value:
        try:
            return yaml.safe_load(expanded)
        except yaml.YAMLError:
            return expanded
    return expanded


# ---------------------------------------------------------------- --set overrides
def _apply_override(data: dict, item: str, source: Source, problems: list[Problem]) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        problems.append(Problem((), f"--set {item!r} is not KEY=VALUE", "write it as --set train.lr=1e-4 (dotted key, '=', YAML value)", (f"--set {item}",)))
        return
    path = tuple(int(p) if p.isdigit() else p for p in key.strip().split("."))
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        problems.append(Problem((path,), f"value {raw!r} is not valid YAML ({getattr(e, 'problem', e)})", "quote it, e.g. --set 'model.name=\"org/model\"'", (f"--set {item}",)))
        return
    target: Any = data
    for i, part in enumerate(path):
        here = path[: i + 1]
        if isinstance(target, list) and not (isinstance(part, int) and part < len(target)):
            problems.append(Problem((here,), f"--set {key}: index {part} is out of range ({dotted(path[:i])} has {len(target)} items)", "use an index that exists", (f"--set {item}",)))
            return
        if not isinstance(target, (dict, list)):
            problems.append(Problem((path[:i],), f"--set {key}: {dotted(path[:i])} is not a section or list, so it has no key {part!r}", "check the dotted key (ft explain lists the keys)", (f"--set {item}",)))
            return
        if i == len(path) - 1:
            break
        if isinstance(target, dict) and target.get(part) is None:
            target[part] = {}  # a section that is absent or written empty ("train:")
        target = target[part]
    target[path[-1]] = value
    source.overrides[path] = item


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
