"""One canonical record shape per data format.

    chat                {"messages": [{"role", "content"}, ...], "images": [path, ...] (one per image marker)}
    instruction         {"messages": [{"role", "content"}, ...]}
    completion          {"text": str}
    prompt_completion   {"prompt": str, "completion": str}
    preference          {"prompt": messages, "chosen": messages, "rejected": messages}
    prompt_only         {"prompt": messages, "extra": JSON text of the other columns}
    unpaired            {"prompt": messages, "completion": messages, "label": bool (true: desirable)}

Every shape keeps the source's `_origin` column. Roles are user, assistant, system and tool. A chat message's images
are marked in its text by finetune/vision.py's PLACEHOLDER, their files (checked, absolute) listed in order.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import uuid
from functools import partial

import datasets

from finetune import vision
from finetune.config.schema import DatasetSpec
from finetune.data.readers import MAX_EXAMPLES, ORIGIN, SKIP_FIX, Progress, short, warn_skipped
from finetune.data.readers import kind as _kind
from finetune.errors import DataError

log = logging.getLogger(__name__)

FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("messages", "system"),
    "instruction": ("instruction", "input", "output", "system"),
    "completion": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected", "system", "margin"),
    "prompt_only": ("prompt", "system"),
    "unpaired": ("prompt", "completion", "label", "system"),
}
ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}
# Column names tried when the ft field's own name is absent and no mapping is given.
_ALIASES = {"messages": ("conversations",)}
# Likely source columns for each ft field, to suggest a mapping.
_HINTS = {
    "messages": ("conversations", "conversation", "dialog", "chat"),
    "instruction": ("prompt", "question", "query"),
    "output": ("response", "answer", "completion", "target"),
    "input": ("context",),
    "text": ("content", "document"),
    "prompt": ("question", "query", "instruction", "input"),
    "completion": ("response", "answer", "output"),
    "chosen": ("accepted", "preferred"),
    "rejected": ("dispreferred",),
    "label": ("desirable", "thumbs_up", "good"),
    "system": ("system_prompt",),
}
_MESSAGES = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
_TEXT = datasets.Value("string")
_PATHS = datasets.List(datasets.Value("string"))
_BOOL = datasets.Value("bool")
_NUMBER = datasets.Value("float64")
_SHAPES = {
    "chat": {"messages": _MESSAGES, "images": _PATHS},
    "instruction": {"messages": _MESSAGES},
    "completion": {"text": _TEXT},
    "prompt_completion": {"prompt": _TEXT, "completion": _TEXT},
    "preference": {
        "prompt": _MESSAGES,
        "chosen": _MESSAGES,
        "rejected": _MESSAGES,
        "margin": _NUMBER,
        "images": _PATHS,
    },
    "prompt_only": {"prompt": _MESSAGES, "extra": _TEXT, "images": _PATHS},
    "unpaired": {"prompt": _MESSAGES, "completion": _MESSAGES, "label": _BOOL, "images": _PATHS},
}


class RecordError(Exception):
    """A record that does not fit its format; the message says what is wrong, the caller adds the origin."""


class MissingColumn(RecordError):
    """The source lacks a column a field is read from: a mapping problem, never skipped as a bad record."""


def features(fmt: str) -> datasets.Features:
    """The Arrow features of normalized records of a format (with `_origin`)."""
    return datasets.Features({**_SHAPES[fmt], ORIGIN: _TEXT})


# ---------------------------------------------------------------- one record
def normalize(record: dict, spec: DatasetSpec) -> dict:
    """The canonical shape of one record of `spec.format`; raises RecordError when it does not fit."""
    out = _NORMALIZERS[spec.format](record, spec)
    if ORIGIN in record:
        out[ORIGIN] = record[ORIGIN]
    return out


def _chat(record: dict, spec: DatasetSpec) -> dict:
    name = _column("messages", spec, record)
    slots: list[str | None] = []  # each image marker's file in order (None: the next of the record's `images`)
    messages = _with_system(_messages(_value(record, "messages", spec), name, slots), _system(record, spec))
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError(f"'{name}' has no assistant message, so there is nothing to train on")
    images = _images(record, slots)
    if images and not any(
        m["content"].replace(vision.PLACEHOLDER, "").strip() for m in messages if m["role"] == "assistant"
    ):
        raise RecordError(f"'{name}': the assistant messages hold no text, so this record has nothing to train on")
    return {"messages": messages, "images": images}


_IN_TEXT = object()  # an image marker written in a message's text (the LLaVA layout), filled from `images`


def _images(record: dict, slots: list) -> list[str]:
    """The record's image files in marker order, each resolved (relative to the data file) and checked."""
    listed = record.get("images", record.get("image"))
    if listed is None:  # no images column: an image marker written in the text is text (LLaVA's layout has both)
        slots[:] = [s for s in slots if s is not _IN_TEXT]
        listed = []
    elif isinstance(listed, str):
        listed = [listed]
    if not isinstance(listed, list):
        raise RecordError(f"'images' must be a list of image paths, got {_kind(listed)}")
    wanted = sum(1 for s in slots if s is None or s is _IN_TEXT)
    if wanted != len(listed):
        raise RecordError(
            f"the messages hold {wanted} {vision.PLACEHOLDER} marker{'s' if wanted != 1 else ''} (or image parts "
            f"without a path) but 'images' lists {len(listed)} image{'s' if len(listed) != 1 else ''}: each listed "
            f"image needs one {vision.PLACEHOLDER} where it belongs in the text, and each marker one image"
        )
    origin = str(record.get(ORIGIN) or "")
    source = origin.rsplit(":", 1)[0] if ":" in origin else None
    queue = iter(listed)
    out = []
    for slot in slots:
        ref = slot if isinstance(slot, str) else next(queue)
        path = None
        try:
            path = vision.resolve(ref, source)
            vision.check_image(path)
        except vision.ImageError as e:
            fetched = path is not None and ref.startswith(("http://", "https://", "data:"))  # a file in ft's cache
            raise RecordError(f"{e} (fetched from {vision.shown_url(ref)})" if fetched else str(e)) from None
        out.append(str(path.resolve()))
    return out


def _instruction(record: dict, spec: DatasetSpec) -> dict:
    instruction = _text(record, "instruction", spec, empty_ok=False)
    extra = _text(record, "input", spec, required=False) or ""
    output = _text(record, "output", spec, empty_ok=False)
    user = instruction + ("\n\n" + extra if extra.strip() else "")
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return {"messages": _with_system(turns, _system(record, spec))}


def _completion(record: dict, spec: DatasetSpec) -> dict:
    return {"text": _text(record, "text", spec, empty_ok=False)}


def _prompt_completion(record: dict, spec: DatasetSpec) -> dict:
    return {"prompt": _text(record, "prompt", spec), "completion": _text(record, "completion", spec, empty_ok=False)}


def _preference(record: dict, spec: DatasetSpec) -> dict:
    names = {f: _column(f, spec, record) for f in ("prompt", "chosen", "rejected")}
    chosen_raw, rejected_raw = _value(record, "chosen", spec), _value(record, "rejected", spec)
    slots: list = []  # the prompt's images (a pair's answers are text)
    if names["prompt"] in record or "prompt" in spec.columns:
        prompt = _turns(_value(record, "prompt", spec), names["prompt"], "user", slots)
    else:
        prompt = _shared_prompt(record, spec, chosen_raw, rejected_raw, names)
    out = {"prompt": _with_system(prompt, _system(record, spec)), **_prompt_images(record, slots)}
    for field, raw in (("chosen", chosen_raw), ("rejected", rejected_raw)):
        turns = _answer(
            raw, names[field], "a preference pair's images belong in its prompt (the answers compared are text)"
        )
        if turns[: len(prompt)] == prompt:
            turns = turns[len(prompt) :]
        if not any(m["role"] == "assistant" for m in turns):
            raise RecordError(f"'{names[field]}' has no assistant message after the prompt")
        out[field] = turns
    margin = _margin(record, spec)
    if margin is not None:
        out["margin"] = margin  # optional: absent from the record, null in the dataset
    return out


def _margin(record: dict, spec: DatasetSpec) -> float | None:
    """A preference pair's optional margin (how much better chosen is; reward models may use it): a finite number."""
    value = _value(record, "margin", spec, required=False)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        name = _column("margin", spec, record)
        raise RecordError(f"'{name}' must be a finite number (how much better chosen is than rejected), got {value!r}")
    return float(value)


def _shared_prompt(record: dict, spec: DatasetSpec, chosen: object, rejected: object, names: dict) -> list[dict]:
    """Without a prompt column, the prompt is the leading messages that chosen and rejected share."""
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise MissingColumn(
            _missing("prompt", record, spec)
            + " (or give chosen and rejected as conversations that start with the prompt)"
        )
    a, b = _messages(chosen, names["chosen"]), _messages(rejected, names["rejected"])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    if n == 0:
        raise RecordError(
            f"no prompt column, and '{names['chosen']}' and '{names['rejected']}' share no leading messages to "
            "use as the prompt"
        )
    return a[:n]


def _prompt_only(record: dict, spec: DatasetSpec) -> dict:
    name = _column("prompt", spec, record)
    slots: list[str | None] = []
    prompt = _with_system(_turns(_value(record, "prompt", spec), name, "user", slots), _system(record, spec))
    used = {_column(f, spec, record) for f in FIELDS["prompt_only"]} | {ORIGIN}
    images: list[str] = []
    # image parts, or the LLaVA layout (markers in the text and an images column)
    if any(s is not _IN_TEXT for s in slots) or record.get("images") or (slots and record.get("image") is not None):
        images = _images(record, slots)
        used |= {"images", "image"}
    extra = {k: v for k, v in record.items() if k not in used}
    return {"prompt": prompt, "extra": json.dumps(extra, ensure_ascii=False, default=str), "images": images}


def _unpaired(record: dict, spec: DatasetSpec) -> dict:
    """One completion with a verdict (KTO): `label` true when the completion is desirable, false when not."""
    names = {f: _column(f, spec, record) for f in ("prompt", "completion", "label")}
    label = _value(record, "label", spec)
    if not isinstance(label, bool):
        raise RecordError(
            f"'{names['label']}' must be true or false (JSON booleans: true for a desirable completion), got "
            f"{label!r}; write it as true/false without quotes"
        )
    slots: list = []  # the prompt's images (the completion judged is text)
    prompt = _turns(_value(record, "prompt", spec), names["prompt"], "user", slots)
    prompt = _with_system(prompt, _system(record, spec))
    completion = _answer(_value(record, "completion", spec), names["completion"], "a row's images belong in its prompt")
    if not any(m["role"] == "assistant" for m in completion):
        raise RecordError(f"'{names['completion']}' has no assistant message to train on")
    return {"prompt": prompt, "completion": completion, "label": label, **_prompt_images(record, slots)}


def _answer(value: object, name: str, where_images_go: str) -> list[dict]:
    """An answer judged (a pair's chosen or rejected, a KTO completion): messages of text, its images in the prompt."""
    slots: list = []
    turns = _turns(value, name, "assistant", slots)
    if any(s is not _IN_TEXT for s in slots):
        raise RecordError(f"'{name}' holds an image; {where_images_go}")
    return turns


def _prompt_images(record: dict, slots: list) -> dict:
    """{"images": the prompt's image files} of a pair or a judged row; {} without images (optional, as margin: absent
    from a text record, null in the dataset)."""
    images = _images(record, slots) if slots or record.get("images") else []
    return {"images": images} if images else {}


_NORMALIZERS = {
    "chat": _chat,
    "instruction": _instruction,
    "completion": _completion,
    "prompt_completion": _prompt_completion,
    "preference": _preference,
    "prompt_only": _prompt_only,
    "unpaired": _unpaired,
}


# ---------------------------------------------------------------- fields, messages
def _column(field: str, spec: DatasetSpec, record: dict) -> str:
    """The source column an ft field is read from: the mapping, the field's name, or a known alias."""
    if field in spec.columns:
        return spec.columns[field]
    if record.get(field) is not None:
        return field
    aliases = _ALIASES.get(field, ())  # a null field may only be another record's column: prefer an alias with a value
    with_value = next((a for a in aliases if record.get(a) is not None), None)
    if with_value is not None or field in record:
        return with_value or field
    return next((a for a in aliases if a in record), field)


def _value(record: dict, field: str, spec: DatasetSpec, *, required: bool = True) -> object:
    """The value of an ft field; None when an optional field is absent or null."""
    name = _column(field, spec, record)
    if name not in record:
        if required or field in spec.columns:
            raise MissingColumn(_missing(field, record, spec))
        return None
    if record[name] is None and required:
        raise RecordError(f"'{name}' is null (or missing in this record)")
    return record[name]


def _missing(field: str, record: dict, spec: DatasetSpec) -> str:
    name = _column(field, spec, record)
    present = [k for k in record if k != ORIGIN]
    used = {spec.columns.get(f, f) for f in FIELDS[spec.format]}
    free = [k for k in present if k not in used]
    guess = next((h for h in _HINTS.get(field, ()) if h in free), None)
    guess = (
        guess
        or next(iter(difflib.get_close_matches(field, free, n=1)), None)
        or (free[0] if len(free) == 1 else "COLUMN")
    )
    return (
        f"no column '{name}' (mapped from ft field '{field}'); columns present: {', '.join(present) or '(none)'}; "
        f"map it with columns: {{{field}: {guess}}}"
    )


def _text(record: dict, field: str, spec: DatasetSpec, *, required: bool = True, empty_ok: bool = True) -> str | None:
    value = _value(record, field, spec, required=required)
    name = _column(field, spec, record)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecordError(f"'{name}' must be text, got {_kind(value)}")
    if not empty_ok and not value.strip():
        raise RecordError(f"'{name}' is empty")
    return value


def _system(record: dict, spec: DatasetSpec) -> str | None:
    """The record's system column when set, else the source's system_prompt."""
    value = _text(record, "system", spec, required=False)
    return value if value and value.strip() else spec.system_prompt


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system and not any(m["role"] == "system" for m in messages):
        return [{"role": "system", "content": system}] + messages
    return messages


def _turns(value: object, name: str, role: str, slots: list | None = None) -> list[dict]:
    """A string becomes one message of `role`; a list is read as messages (`slots`: see _messages)."""
    if isinstance(value, str):
        if not value.strip():
            raise RecordError(f"'{name}' is empty")
        if slots is not None:
            slots.extend([_IN_TEXT] * value.count(vision.PLACEHOLDER))
        return [{"role": role, "content": value}]
    return _messages(value, name, slots)


def _messages(value: object, name: str, slots: list | None = None) -> list[dict]:
    """Messages read from a list (or JSON text); `slots` (chat records): where image markers are allowed, each one
    found appends its file (or None: the next of the record's `images`)."""
    if isinstance(value, str) and value.lstrip().startswith("["):  # a conversation stored as JSON text (CSV)
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RecordError(
                f"'{name}' holds text that is not a valid JSON list of messages ({e.msg} at column {e.colno})"
            ) from None
    if not isinstance(value, list):
        raise RecordError(f"'{name}' must be a list of messages, got {_kind(value)}")
    if not value:
        raise RecordError(f"'{name}' is an empty conversation")
    return [_message(m, f"{name}[{i}]", slots) for i, m in enumerate(value)]


def _message(message: object, where: str, slots: list | None = None) -> dict:
    """An OpenAI-style {role, content} or ShareGPT-style {from, value} message, detected per message."""
    if not isinstance(message, dict):
        raise RecordError(f"message {where} must be an object with role and content, got {_kind(message)}")
    keys = ("role", "content") if message.get("role") is not None else ("from", "value")
    role, content = message.get(keys[0]), message.get(keys[1])
    if role is None:
        present = ", ".join(k for k, v in message.items() if v is not None) or "(none)"
        raise RecordError(
            f"message {where} has no role: expected role/content (OpenAI style) or from/value (ShareGPT style); "
            f"keys present: {present}"
        )
    if not isinstance(role, str) or role.strip().lower() not in ROLES:
        raise RecordError(
            f"message {where} has an unknown role {role!r}; use user, assistant, system or tool (ShareGPT: human, gpt)"
        )
    if content is None:
        raise RecordError(f"message {where} ({role}) has no '{keys[1]}'")
    if slots is not None and isinstance(content, list):
        content = _parts(content, f"message {where} ({role})", slots)
    elif slots is not None and isinstance(content, str):
        slots.extend([_IN_TEXT] * content.count(vision.PLACEHOLDER))
    if not isinstance(content, str):
        raise RecordError(
            f"message {where} ({role}): '{keys[1]}' must be a string, got {_kind(content)}; ft reads text messages only"
        )
    return {"role": ROLES[role.strip().lower()], "content": content}


def _parts(parts: list, where: str, slots: list) -> str:
    """Content parts ({"type": "text", "text"}, {"type": "image", "image": PATH}) as text with image markers."""
    out = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if vision.PLACEHOLDER in part["text"]:
                raise RecordError(
                    f"{where}: text part {k} holds {vision.PLACEHOLDER!r}, which marks images; put images in parts of "
                    'type "image"'
                )
            out.append(part["text"])
        elif kind in ("image", "image_url"):
            ref = part.get("image", part.get("path", part.get("url", part.get("image_url"))))
            if isinstance(ref, dict):  # OpenAI style: {"image_url": {"url": ...}}
                ref = ref.get("url")
            if ref is not None and not isinstance(ref, str):
                raise RecordError(f"{where}: image part {k} must give its file as a path, got {_kind(ref)}")
            slots.append(ref)
            out.append(vision.PLACEHOLDER)
        else:
            raise RecordError(
                f'{where}: part {k} must be {{"type": "text", "text": ...}} or {{"type": "image", "image": PATH}}, '
                f"got {short(part)}"
            )
    return "".join(out)


# ---------------------------------------------------------------- a whole dataset
def normalize_dataset(
    ds: datasets.Dataset,
    spec: DatasetSpec,
    *,
    skip_bad_records: bool = False,
    num_proc: int = 1,
    key: str = "",
    examples: list[str] | None = None,
    progress: Progress | None = None,
) -> tuple[datasets.Dataset, int]:
    """Normalize every record; returns (normalized dataset, records skipped).

    A bad record raises DataError "ORIGIN: MESSAGE" naming the source (`key`, e.g. "data.datasets[0]"),
    or with skip_bad_records is dropped and counted, and the first few are logged and appended to
    `examples` as "ORIGIN: REASON". A source whose every record is bad is an error even then. A missing
    column always raises: it is the mapping. progress(stage, done, total) is called per batch (num_proc 1).
    """
    source = f"{key} (path {spec.path}, format {spec.format})" if key else f"{spec.path} (format {spec.format})"
    out = _map(ds, spec, skip_bad_records, num_proc, (key, source), progress)
    errors = [e for e in out["_error"][:] if e] if skip_bad_records else []
    if errors and len(errors) == len(out):
        raise DataError(
            f"{errors[0]}\n    source: {source}: every record is bad ({len(errors)} skipped), so nothing is left "
            f"to train on; others: {'; '.join(errors[1:3]) or 'none'}\n    fix: correct the records, or check that "
            "data.datasets[].format matches the data"
        )
    if errors:
        warn_skipped(log, source, len(errors), errors)
        if examples is not None:
            examples.extend(errors[: max(0, MAX_EXAMPLES - len(examples))])
        out = out.filter(lambda e: not e, input_columns="_error")
    return out.remove_columns("_error"), len(errors)


def _map(
    ds: datasets.Dataset,
    spec: DatasetSpec,
    skip: bool,
    num_proc: int,
    where: tuple[str, str],
    progress: Progress | None,
) -> datasets.Dataset:
    shape = datasets.Features({**features(spec.format), "_error": _TEXT})
    fn = partial(_normalize_batch, spec=spec, skip=skip, where=where, columns=tuple(shape))
    procs = min(num_proc, len(ds)) if num_proc > 1 and len(ds) > 1 else None
    if progress is not None and procs is None:
        total, done, inner = len(ds), [0], fn

        def fn(batch: dict, indices: list[int]) -> dict:
            rows = inner(batch, indices)
            done[0] += len(indices)
            progress(f"reading {spec.path} as {spec.format}", done[0], total)
            return rows

    return ds.map(
        fn,
        batched=True,
        with_indices=True,
        remove_columns=ds.column_names,
        features=shape,
        num_proc=procs,
        desc=f"Reading {spec.path} as {spec.format}",
        new_fingerprint=uuid.uuid4().hex,
    )


def _normalize_batch(
    batch: dict, indices: list[int], *, spec: DatasetSpec, skip: bool, where: tuple[str, str], columns: tuple
) -> dict:
    rows = []
    for j, index in enumerate(indices):
        record = {k: values[j] for k, values in batch.items()}
        origin = record.get(ORIGIN) or f"{spec.path}:record {index + 1}"
        try:
            row = {**normalize(record, spec), "_error": ""}
        except RecordError as e:
            if not skip or isinstance(e, MissingColumn):
                raise _record_error(origin, e, *where) from None
            row = {
                k: [] if v is _MESSAGES or v is _PATHS else False if v is _BOOL else None if v is _NUMBER else ""
                for k, v in _SHAPES[spec.format].items()
            } | {"_error": f"{origin}: {e}"}
        row[ORIGIN] = origin
        rows.append(row)
    return {k: [r.get(k) for r in rows] for k in columns}  # an optional field a record lacks is null


def _record_error(origin: str, e: RecordError, key: str, source: str) -> DataError:
    if isinstance(e, MissingColumn):
        fix = (
            f"map the column in {key + '.columns' if key else 'the source columns'}, or choose the format that "
            "matches the data"
        )
    else:
        fix = SKIP_FIX
    return DataError(f"{origin}: {e}\n    source: {source}\n    fix: {fix}")
