"""The hub, asked once per process and never waited for: what a model name that is not a local folder needs.

A file that huggingface_hub could not fetch because the network failed, and that is not cached, is fetched again with
retries (huggingface_hub 2.4 file_download.py `_hf_hub_download_to_cache_dir`: a HEAD without retries, then again
with `retry_on_errors=True`, which utils/_http.py `_http_backoff_base` retries 5 times, 1 + 2 + 4 + 8 + 8 s, printing
each): about 28 s before a compute node without hub access hears "not found". So ft asks first with one metadata
request that huggingface_hub does not retry (`get_hf_file_metadata`, whose `retry_on_errors` is off by default). When
no answer comes (the endpoint's name does not resolve, no connection, a timeout), every later load in this process
reads the local cache only (`local_files_only=True`), and ft says once what to do. HF_HUB_OFFLINE=1 needs none of
this: huggingface_hub then reads the cache without asking.
"""

from __future__ import annotations

from urllib.parse import urlsplit

_answers: dict[str, str] = {}  # endpoint -> why it could not be reached ('' where it answered)


def endpoint() -> str:
    """The hub's address (HF_ENDPOINT, else huggingface.co) without anything written into it but scheme, host, port."""
    from huggingface_hub import constants

    parts = urlsplit(constants.ENDPOINT)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname or ''}{port}"


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set: huggingface_hub asks nothing and reads the cache."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def unreachable(name: str, revision: str = "main") -> str:
    """Why the hub cannot be reached from here, in a few words ('' when it answers, even "no such model", and when
    offline mode is set). The first call asks for `name`'s config.json once, without retries; later calls reuse
    that answer."""
    if offline():
        return ""
    where = endpoint()
    if where not in _answers:
        _answers[where] = _ask(name, revision)
    return _answers[where]


def _ask(name: str, revision: str) -> str:
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json", revision=revision or None))
    except (HfHubHTTPError, HFValidationError):  # an answer (no such repo, gated, a bad id): the load itself says so
        return ""
    except Exception as e:  # noqa: BLE001 - no answer: name resolution, connection, proxy, TLS, timeout
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0] if text else ''}"[:200]
    return ""


def cached(name: str, filename: str = "config.json", revision: str = "main") -> bool:
    """`filename` of `name` is in the local hub cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, filename, revision=revision or None), str)


def fixes() -> str:
    """What to do when the hub cannot be reached, for the end of an error message."""
    return (
        "give a local folder instead (fetched where the hub is reachable, e.g. `hf download NAME --local-dir DIR`), "
        "set HF_HUB_OFFLINE=1 to use the local cache without asking the hub, or point HF_ENDPOINT at a mirror"
    )


def unreachable_message(name: str, key: str, reason: str) -> str:
    """One message for a hub id that is neither cached nor fetchable because the hub does not answer."""
    return (
        f"{key}: {name!r} is not a local folder and not in the local cache, and the hub ({endpoint()}) cannot be "
        f"reached from here ({reason}).\n    fix: {fixes().replace('NAME', name)}"
    )
