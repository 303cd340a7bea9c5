"""User functions named in a config, on the command line or in an environment variable: metrics for `ft eval`,
rewards for GRPO, test and debug hooks (FT_STEP_HOOK, see finetune/rank.py).

A spec is `package.module:function` (imported from the Python path, the current folder included) or
`path/to/file.py:function` (a file, relative to the current folder or absolute). Every failure is an
FtError naming the config key, the spec, what went wrong and how to fix it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from finetune.errors import FtError

_FORMS = "write it as package.module:function or path/to/file.py:function"
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def load_function(spec: str, key: str) -> Callable:
    """The callable a spec names; FtError (naming `key` and `spec`) when it cannot be loaded."""
    where, _, name = str(spec).strip().rpartition(":")
    if not where or not name:
        raise FtError(f"{key}: {spec!r} does not name a function.\n    fix: {_FORMS}")
    if not _IDENTIFIER.fullmatch(name):
        raise FtError(f"{key}: {spec!r}: {name!r} is not a function name.\n    fix: {_FORMS}")
    looks_like_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _from_file(where, spec, key) if looks_like_file else _from_module(where, spec, key)
    if not hasattr(module, name):
        found = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        listed = f" (it defines: {', '.join(found[:10])})" if found else ""
        raise FtError(
            f"{key}: {spec!r}: {where} has no attribute {name!r}{listed}.\n    fix: correct the name after the colon"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise FtError(
            f"{key}: {spec!r}: {name} in {where} is a {type(fn).__name__}, not a function.\n    fix: point at a "
            f"function (def {name}(...))"
        )
    return fn


def _from_module(where: str, spec: str, key: str):
    if not all(_IDENTIFIER.fullmatch(part) for part in where.split(".")):
        raise FtError(f"{key}: {spec!r}: {where!r} is neither a module name nor a .py file.\n    fix: {_FORMS}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # `module:function` finds modules next to the config, as `python -m` would
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and (where == e.name or where.startswith(e.name + ".")):
            raise FtError(
                f"{key}: {spec!r}: no module named {e.name!r} (searched the Python path and {cwd}).\n"
                "    fix: install the package, run from the folder that holds it, or give the file: "
                f"path/to/{where.replace('.', '/')}.py:{spec.rpartition(':')[2]}"
            ) from None
        raise _import_failed(key, spec, where, e) from None
    except Exception as e:  # the module's own code failed while importing
        raise _import_failed(key, spec, where, e) from None


def _from_file(where: str, spec: str, key: str):
    path = Path(where).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    if not path.is_file():
        hint = " (a folder: name the .py file inside it)" if path.is_dir() else ""
        raise FtError(
            f"{key}: {spec!r}: the file {where} does not exist{hint}; relative paths are read from {os.getcwd()}.\n"
            "    fix: correct the path, or give an absolute one"
        )
    if path.suffix != ".py":
        raise FtError(f"{key}: {spec!r}: {where} is not a .py file.\n    fix: {_FORMS}")
    resolved = path.resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"ft_user_{stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look modules up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _import_failed(key, spec, where, e) from None
    return module


def _import_failed(key: str, spec: str, where: str, e: BaseException) -> FtError:
    first = (str(e).strip().splitlines() or [""])[0]
    run = f"python {where}" if where.endswith(".py") else f"python -c 'import {where}'"
    return FtError(
        f"{key}: {spec!r}: importing {where} failed with {type(e).__name__}: {first}\n"
        f"    fix: run `{run}` to see the full error, and correct the code"
    )
