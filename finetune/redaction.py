"""Keeping secrets out of what ft writes: run folder files, the model card, trackers, logs.

Two kinds of secrets are recognised. Values of secret-looking keys and secret-looking strings (tokens,
keys, passwords in URLs) are replaced by "***", whatever their source. And any value of a job file that
took text from the environment (`${HF_TOKEN}`) is written back as its reference, whatever its key: the
loader records those key paths on the `Config` (`Config.env_references()`).
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


def redact_config(config: Any, exclude_unset: bool = False) -> dict:
    """A job's config as a JSON-ready dict to write out: secrets redacted, and every value that took text from
    the environment written back as its `${VAR}` reference, whatever its key.

    The run folder's config.yaml written this way loads again (ranks read it) and re-reads the environment.
    Numbers and booleans read from `${VAR}` keep their value: they are not secrets, and later readers of the
    run folder then need no environment.
    """
    data = redact(config.model_dump(mode="json", exclude_unset=exclude_unset))
    for path, text in config.env_references().items():
        holder, key = _holder(data, path)
        if holder is not None and not isinstance(holder[key], (bool, int, float, type(None))):
            holder[key] = text
    return data


def is_config(obj: Any) -> bool:
    return callable(getattr(obj, "env_references", None)) and hasattr(obj, "model_dump") and not isinstance(obj, type)


def _holder(data: Any, path: tuple) -> tuple[Any, Any]:
    """(the dict or list holding `path`'s value, its key), or (None, None) when `data` has no such path."""
    for part in path[:-1]:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return None, None
    if not path or not isinstance(data, (dict, list)):
        return None, None
    if (
        isinstance(data, dict)
        and path[-1] in data
        or isinstance(data, list)
        and isinstance(path[-1], int)
        and path[-1] < len(data)
    ):
        return data, path[-1]
    return None, None


_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


def _env_texts(config: Any) -> dict[str, str]:
    """Environment text -> its `${VAR}`, for the variables read by references that are written back as text."""
    if not is_config(config):
        return {}
    variables = config.env_variables()
    dumped = config.model_dump(mode="json")
    names: set[str] = set()
    for path, text in config.env_references().items():
        holder, key = _holder(dumped, path)
        if holder is not None and not isinstance(holder[key], (bool, int, float, type(None))):
            names.update(_REFERENCE.findall(text))
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
