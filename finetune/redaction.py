"""Keeping secrets out of what ft writes: run folder files, the model card, trackers, logs.

Values of secret-looking keys and secret-looking strings (tokens, keys, passwords in URLs) are replaced by
"***", whatever their source. A value of a job file that took text from the environment (the loader records
those key paths on the `Config`: `Config.env_references()`) is written out as the value it had, so that a
run folder records everything it was trained with, unless the reference is a secret: then it is written
back as its reference (`${HF_TOKEN}`). A reference is a secret when its key or one of its variables has a
secret-looking name (HF_TOKEN, WANDB_API_KEY, DB_PASSWORD, SSH_KEY, ...), or a variable's value looks like
a secret, or another reference to that variable is one.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"

# Key names whose values are secrets. "token" is matched, but not "tokens", "tokenizer", "token_id" or the
# tokenizer's special tokens (pad_token, eos_token, ...); "auth" is matched, but not "author".
SECRET_KEY = re.compile(
    r"(?<!pad_)(?<!eos_)(?<!bos_)(?<!unk_)(?<!sep_)(?<!cls_)(?<!mask_)token(?!s|iz|_id)"
    r"|secret|passw(?:or)?d|api[_-]?key|auth(?!or(?!iz))|credential|private[_-]?key|access[_-]?key",
    re.IGNORECASE,
)

# Secret-looking values, wherever they appear inside a string: (pattern, replacement).
# credential in a URL query
_SECRET_VALUES = [
    (re.compile(r"hf_[A-Za-z0-9]{30,}"), REDACTED),  # Hugging Face token
    (re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![A-Za-z0-9])"), REDACTED),  # AWS access key id
    (re.compile(r"gh[pousr]_[A-Za-z0-9]{30,}"), REDACTED),  # GitHub token
    (re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_-]{20,}"), REDACTED),  # OpenAI-style key
    (re.compile(r"(\bBearer\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE), r"\1" + REDACTED),
    (re.compile(r"(://[^/\s:@]+:)[^/\s@]+@"), r"\1" + REDACTED + "@"),  # password in a URL
    (
        re.compile(r"([?&](?:[a-z_]*token|api_?key|key|secret|password|sig|signature)=)[^&#\s]+", re.IGNORECASE),
        r"\1" + REDACTED,
    ),
]
# A wandb API key is 40 lowercase hex characters; so is a git commit or a model revision, hence the key check.
_HEX40 = re.compile(r"(?<![0-9a-zA-Z])[0-9a-f]{40}(?![0-9a-zA-Z])")
_HASH_KEY = re.compile(r"commit|revision|sha|hash|fingerprint|digest|checksum", re.IGNORECASE)
# Environment variable names that hold secrets besides SECRET_KEY's: a KEY or PASS part (SSH_KEY, DB_PASS), not
# MONKEY, KEYBOARD or PASSAGE.
SECRET_VARIABLE = re.compile(r"(?:^|_)(?:KEYS?|PASS|PASSPHRASE)(?:_|$)", re.IGNORECASE)


def secret_variable(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (HF_TOKEN, WANDB_API_KEY, SSH_KEY, DB_PASS)."""
    return bool(SECRET_KEY.search(name) or SECRET_VARIABLE.search(name))


def redact(obj: Any, _key: str = "", config: Any = None) -> Any:
    """A copy of `obj` with secrets replaced by "***": values of secret-looking keys, and secret-looking strings.

    Dicts, lists and tuples are copied deeply (a pydantic model becomes its JSON dict); the input is never
    changed. None, booleans and empty strings under a secret key are kept: they reveal nothing. A job's
    `Config` goes through `redact_config`; with `config=`, the text its `${VAR}` references read from the
    environment is also replaced, wherever it appears, by the reference.
    """
    if is_config(obj):
        return redact_config(obj)
    if config is not None:
        obj = _scrub(obj, _env_texts(config))
    if hasattr(obj, "model_dump") and not isinstance(obj, type):
        obj = obj.model_dump(mode="json")
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            name = str(key)
            if SECRET_KEY.search(name) and value not in (None, "") and not isinstance(value, bool):
                out[key] = REDACTED
            else:
                out[key] = redact(value, name)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, _key) for v in obj)
    if isinstance(obj, str):
        return _redact_text(obj, hashes_allowed=bool(_HASH_KEY.search(_key)))
    return obj


def redact_config(config: Any, exclude_unset: bool = False, as_references: bool = False) -> dict:
    """A job's config as a JSON-ready dict to write out: secrets redacted, a value that took text from the environment
    written as it was (the run folder records what it was trained with), and a secret reference
    (`secret_references`) written back as its `${VAR}`.

    The run folder's config.yaml written this way loads again (ranks read it) and re-reads the environment only for
    its secrets. With `as_references`, every value from the environment is written back as its reference, as ft
    wrote run folders before it recorded values (to compare with those). Numbers and booleans read from `${VAR}`
    keep their value unless their key is a secret: later readers of the run folder then need no environment.
    """
    data = redact(config.model_dump(mode="json", exclude_unset=exclude_unset))
    kept = config.env_references() if as_references else secret_references(config)
    for path, text in kept.items():
        holder, key = _holder(data, path)
        if holder is not None and not isinstance(holder[key], (bool, int, float, type(None))):
            # a secret typed next to the reference (https://me:PASSWORD@${HOST}/...) is hidden all the same
            holder[key] = text if as_references else _redact_text(text, bool(_HASH_KEY.search(str(path[-1]))))
    return data


def secret_references(config: Any) -> dict[tuple, str]:
    """The config's `${VAR}` references (key path -> text as written) whose value must not be written out: under a
    secret key or where `redact` would hide something, reading a secret-named variable (SECRET_KEY, or a KEY or PASS
    part: SSH_KEY, DB_PASS) or one whose value looks like a secret, or reading a variable that another secret
    reference reads."""
    variables = config.env_variables()
    raw = config.model_dump(mode="json")
    redacted = redact(raw)
    names = {path: set(_REFERENCE.findall(text)) & set(variables) for path, text in config.env_references().items()}
    secret = {path for path in names if _secret_path(path, names[path], variables, raw, redacted)}
    shared = {name for path in secret for name in names[path]}
    return {path: text for path, text in config.env_references().items() if path in secret or names[path] & shared}


def _secret_path(path: tuple, names: set[str], variables: dict, raw: dict, redacted: dict) -> bool:
    holder, key = _holder(redacted, path)
    before, _ = _holder(raw, path)
    if holder is None or before is None or holder[key] != before[key] or "${" in str(before[key]):
        return True  # redact hid it (or a section above it); a value holding ${ would expand again when read back
    if any(SECRET_KEY.search(str(part)) for part in path):
        return True
    hashes = bool(_HASH_KEY.search(str(path[-1])))
    for name in names:
        value = variables[name]
        if secret_variable(name):
            return True
        if _redact_text(value, hashes_allowed=hashes or bool(_HASH_KEY.search(name))) != value:
            return True
    return False


def is_config(obj: Any) -> bool:
    return callable(getattr(obj, "env_references", None)) and hasattr(obj, "model_dump") and not isinstance(obj, type)


def _holder(data: Any, path: tuple) -> tuple[Any, Any]:
    """(the dict or list holding `path`'s value, its key), or (None, None) when `data` has no such path."""
    for part in path[:-1]:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None, None
    if not path:
        return None, None
    key = path[-1]
    if isinstance(data, dict) and key in data or isinstance(data, list) and isinstance(key, int) and key < len(data):
        return data, key
    return None, None


_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def _env_texts(config: Any) -> dict[str, str]:
    """Environment text -> its `${VAR}`, for the variables that secret references read."""
    if not is_config(config):
        return {}
    variables = config.env_variables()
    names = {name for text in secret_references(config).values() for name in _REFERENCE.findall(text)}
    return {variables[n]: f"${{{n}}}" for n in names if n in variables and len(variables[n]) >= 4}


def _scrub(obj: Any, texts: dict[str, str]) -> Any:
    """`obj` with each occurrence of the keys of `texts` in its strings replaced by their values."""
    if not texts:
        return obj
    if is_config(obj):
        return redact_config(obj)
    if hasattr(obj, "model_dump") and not isinstance(obj, type):
        obj = obj.model_dump(mode="json")
    if isinstance(obj, dict):
        return {k: _scrub(v, texts) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_scrub(v, texts) for v in obj)
    if isinstance(obj, str):
        for secret in sorted(texts, key=len, reverse=True):
            obj = obj.replace(secret, texts[secret])
    return obj


def _redact_text(text: str, hashes_allowed: bool) -> str:
    for pattern, replacement in _SECRET_VALUES:
        text = pattern.sub(replacement, text)
    return text if hashes_allowed else _HEX40.sub(REDACTED, text)


def leaks(text: str, environ: dict[str, str] | None = None) -> list[str]:
    """What in `text` must not leave the machine, named without the value: each secret-named variable of the environment
    (SECRET_KEY or SECRET_VARIABLE: HF_TOKEN, WANDB_API_KEY, SSH_KEY, ...) whose value (8 characters or more) it holds,
    and "a token, key or password" where it holds text `redact` hides (a token's shape, a password in a URL; a 40-hex
    string, which is also a commit hash, only as a variable's value). [] when there is none."""
    import os

    env = os.environ if environ is None else environ
    found = sorted(name for name, value in env.items() if secret_variable(name) and len(value) >= 8 and value in text)
    if _redact_text(text, hashes_allowed=True) != text:
        found.append("a token, key or password")
    return found
