"""Turn pydantic's validation errors into `Problem`s a person can act on.

pydantic reports one error per union member (`micro_batch_size: big` fails both `'auto'` and `int`) and
puts the discriminator value into the location (`method.dpo.beta`). We walk the schema along each
error's location to find the real key path, merge the errors of one key into one message, and add
"did you mean" suggestions for unknown keys and values.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel

from finetune.config.docs import field_text
from finetune.config.schema import Config
from finetune.errors import Problem, clip, dotted


def translate(errors: list[dict]) -> list[Problem]:
    """pydantic `ValidationError.errors()` -> one Problem per key, in the order first seen."""
    grouped: dict[tuple, list[dict]] = {}
    owners: dict[tuple, type[BaseModel] | None] = {}
    for err in errors:
        path, owner = resolve(err["loc"])
        grouped.setdefault(path, []).append(err)
        owners[path] = owner
    return [_problem(path, errs, owners[path]) for path, errs in grouped.items()]


def resolve(loc: tuple) -> tuple[tuple, type[BaseModel] | None]:
    """Walk the schema along `loc`; return the key path without union tags and the model owning its last key."""
    tp: Any = Config
    path: list = []
    owner: type[BaseModel] | None = None
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            owner = tp
            path.append(part)
            if part not in tp.model_fields:
                break
            tp = tp.model_fields[part].annotation
        elif get_origin(tp) is list and isinstance(part, int):
            path.append(part)
            tp = get_args(tp)[0]
        elif get_origin(tp) is dict:
            path.append(part)
            tp = get_args(tp)[1]
        elif _is_union(tp):
            member = _tagged_member(tp, part)
            if member is None:
                break  # a union member tag such as "int" or "literal['auto']": not part of the key
            tp = member
        else:
            break
    return tuple(path), owner


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) is typing.Annotated:
        tp = get_args(tp)[0]
    if _is_union(tp):
        members = [m for m in get_args(tp) if m is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return tp


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _tagged_member(tp: Any, tag: Any) -> Any:
    for member in get_args(tp):
        member = _unwrap(member)
        if isinstance(member, type) and issubclass(member, BaseModel) and "name" in member.model_fields:
            if tag in get_args(member.model_fields["name"].annotation):
                return member
    return None


# ---------------------------------------------------------------- messages
def _problem(path: tuple, errs: list[dict], owner: type[BaseModel] | None) -> Problem:
    kinds = {e["type"] for e in errs}
    key = path[-1] if path else ""
    if kinds == {"ft"}:  # ft's own checks (finetune.config.types) carry their message and fix
        ctx = errs[0].get("ctx") or {}
        return Problem((path,), str(ctx.get("message", errs[0]["msg"])), str(ctx.get("fix", "")))
    if "extra_forbidden" in kinds:
        return Problem((path,), f"unknown key {clip(repr(key))}", _suggest_key(key, owner, path))
    if "missing" in kinds:
        return Problem((path,), "required key is missing", f"add {key}: ... — {_doc(owner, key)}")
    if "union_tag_invalid" in kinds or "union_tag_not_found" in kinds:
        ctx = errs[0].get("ctx", {})
        tags = ctx.get("expected_tags", "sft, dpo, grpo").replace("'", "")
        got = ctx.get("tag")
        msg = f"{got!r} is not one of: {tags}" if got is not None else f"needs a `name`: one of {tags}"
        return Problem(
            (path + ("name",),), msg, _closest(got, tags.split(", ")) if got else f"add name: {tags.split(', ')[0]}"
        )
    got = errs[0].get("input")
    if kinds == {"literal_error"}:
        allowed = errs[0].get("ctx", {}).get("expected", "")
        return Problem(
            (path,),
            f"{got!r} is not allowed; expected {allowed}",
            _closest(got, [a.strip(" '") for a in allowed.replace(" or ", ", ").split(", ")]),
        )
    wanted = " or ".join(dict.fromkeys(_wanted(e) for e in errs))
    doc = _doc(owner, key)
    return Problem((path,), f"should be {wanted}; got {_show(got)}", f"{key}: {doc}" if doc else "")


def _wanted(err: dict) -> str:
    msg = err["msg"]
    for prefix in ("Input should be ", "should be ", "Value error, ", "List should have ", "Dictionary should have "):
        if msg.startswith(prefix):
            msg = ("a list with " if prefix.startswith("List") else "") + msg[len(prefix) :]
            break
    return msg.split(", unable to")[0].split(" [")[0]


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{clip(repr(value), 60)} ({type(value).__name__})"


def _doc(owner: type[BaseModel] | None, key: Any) -> str:
    if owner is None or key not in getattr(owner, "model_fields", {}):
        return ""
    return field_text(owner.model_fields[key])


def _suggest_key(key: Any, owner: type[BaseModel] | None, path: tuple) -> str:
    fields = list(owner.model_fields) if owner else []
    close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    elsewhere = [
        f"{section}.{key}"
        for section, f in Config.model_fields.items()
        if isinstance(_unwrap(f.annotation), type) and key in getattr(_unwrap(f.annotation), "model_fields", {})
    ]
    if elsewhere and elsewhere[0] != dotted(path):
        return f"{key!r} belongs in another section: did you mean {elsewhere[0]!r}?"
    return f"valid keys here: {', '.join(fields)}" if fields else "remove it"


def _closest(got: Any, allowed: list[str]) -> str:
    close = difflib.get_close_matches(str(got), allowed, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(allowed)}"
