"""Value types of the schema that check more than pydantic does by itself.

- `Bounded(int, ge=1, le=10**9)`: a number within sane bounds that is not a boolean (YAML's `true` is
  not a step count, although Python counts it as 1).
- `checked_path` / `checked_text`: strings that reach the file system or the hub: no control characters
  (a NUL ends a path in C), and lengths the file system accepts.
- `checked_template`: `data.template` is `tokenizer`, a built-in name, or a path; anything else is a
  typo, reported with the closest name.
- `checked_pattern`: a regular expression that compiles.

Errors are `PydanticCustomError("ft", ...)` carrying their own fix; `finetune.config.errors` shows them.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticCustomError

MAX_PATH = 1024  # characters of a path, hub id or module reference
MAX_NAME = 255  # characters of one path component, or of a name
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def fail(message: str, fix: str = "") -> PydanticCustomError:
    """A validation error with ft's own message and fix."""
    return PydanticCustomError("ft", "{message}", {"message": message, "fix": fix})


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise fail(f"should be a number, not the boolean {str(value).lower()}", "write a number")
    return value


NoBool = BeforeValidator(_no_bool)


def Bounded(tp: type, **limits: Any) -> Any:  # noqa: N802 - reads as a type in annotations
    """`tp` within `limits` (ge, gt, le, lt), booleans refused."""
    return Annotated[tp, NoBool, Field(**limits)]


def _no_control(value: str) -> None:
    m = _CONTROL.search(value)
    if m is not None:
        char = "NUL" if m.group() == "\0" else f"U+{ord(m.group()):04X}"
        raise fail(f"contains the control character {char}", "remove it")


def _path(value: str) -> str:
    _no_control(value)
    if len(value) > MAX_PATH:
        raise fail(f"is {len(value):,} characters long; at most {MAX_PATH} are allowed", "use a shorter path or name")
    longest = max(value.replace("\\", "/").split("/"), key=len)
    if len(longest) > MAX_NAME:
        raise fail(
            f"has a part of {len(longest):,} characters between slashes; file and folder names have at most {MAX_NAME}",
            "use shorter names",
        )
    return value


def _text(value: str) -> str:
    _no_control(value)
    if len(value) > MAX_NAME:
        raise fail(f"is {len(value):,} characters long; at most {MAX_NAME} are allowed", "use a shorter name")
    return value


def _template(value: str) -> str:
    from finetune.templates import BUILTIN

    jinja = "{{" in value or "{%" in value
    if not jinja:
        _path(value)
    if value == "tokenizer" or value in BUILTIN or jinja:
        return value  # a name, or Jinja text
    if "/" in value or "\\" in value or value.startswith(("~", ".")) or Path(value).suffix in (".jinja", ".j2", ".txt"):
        return value  # a path: read when the data is prepared
    if Path(value).is_file():
        return value
    names = ["tokenizer", *BUILTIN]
    close = difflib.get_close_matches(value.lower(), names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise fail(
        f"unknown template {value!r}: not a built-in and no file of that name",
        f"{hint}use tokenizer, a built-in ({', '.join(BUILTIN)}) or the path of a .jinja file",
    )


def _pattern(value: str) -> str:
    try:
        re.compile(value)
    except re.error as e:
        raise fail(
            f"is not a valid regular expression ({e})",
            "fix the pattern; test it with python -c 'import re; re.compile(...)'",
        ) from None
    except (OverflowError, RecursionError):
        raise fail("is too complex a regular expression", "simplify the pattern") from None
    return value


checked_path = AfterValidator(_path)
checked_text = AfterValidator(_text)
checked_template = AfterValidator(_template)
checked_pattern = AfterValidator(_pattern)
