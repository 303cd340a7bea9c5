"""Prompts for generation and evaluation, from a data file or from a dataset of a job file.

A data file (.jsonl, .json, .csv, .parquet) is read by `finetune.data.sources`, so every record keeps
its file:line origin for error messages. The prompt is the first column present of PROMPT_FIELDS (or
the one named): a list of messages (OpenAI or ShareGPT style), or a text that becomes one user message.
The reference answer, used by metrics, is a conversation's final assistant message, else the first
column present of REFERENCE_FIELDS. A record's id is its `id` column (or the one named), else its
position in the file, counted from 0.

A job file's dataset is read with its own format, column mapping and system prompt, as training read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.data.sources import ORIGIN
from finetune.errors import DataError
from finetune.infer.store import id_key

PROMPT_FIELDS = ("messages", "conversations", "prompt", "instruction", "question", "input", "text")
REFERENCE_FIELDS = ("answer", "reference", "output", "completion", "target")
NO_TEMPLATE = "none"


@dataclass(frozen=True)
class PromptSpec:
    """Where prompts come from and how they are read."""

    path: str
    dataset: str | None = None  # job file only: "validation" or an index into data.datasets
    prompt_field: str | None = None
    reference_field: str | None = None
    id_field: str = "id"
    system: str | None = None
    samples: int | None = None  # the first N records only


@dataclass(frozen=True)
class Prompt:
    """One input record and what is generated from it."""

    index: int  # position among the inputs
    id: object
    origin: str  # "file.jsonl:12"
    fields: dict  # the record as read, for the output row and for metric functions
    messages: tuple  # the conversation the model answers
    text: str | None  # the prompt as plain text: given as text, or a lone user message
    reference: str | None
    images: tuple[str, ...] = ()  # absolute paths, one per image marker (finetune.vision.PLACEHOLDER) in the messages


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    template: str | None  # the job file's data.template (`none` for raw-text formats); None: caller's choice
    where: str  # what was read, for messages


def read_prompts(spec: PromptSpec) -> PromptSet:
    """The prompts `spec` names, in input order, with unique ids."""
    suffix = Path(spec.path).suffix.lower()
    prompt_set = _from_job(spec) if suffix in (".yaml", ".yml") else _from_file(spec)
    if not prompt_set.prompts:
        raise DataError(f"{prompt_set.where}: no prompts to read")
    return prompt_set


def columns(prompts: list[Prompt]) -> dict[str, list]:
    """Each input field as a list over the prompts (None where a record lacks it): what metric functions get."""
    names = dict.fromkeys(k for p in prompts for k in p.fields)
    return {k: [p.fields.get(k) for p in prompts] for k in names}


def template_for(tokenizer, spec: str):
    """Jinja source for a template spec (`tokenizer`, a built-in, a file), or None for `none` (raw text)."""
    from finetune.templates import BUILTIN, TemplateError, resolve

    if spec == NO_TEMPLATE:
        return None
    try:
        return resolve(tokenizer, spec)
    except TemplateError:
        if spec != "tokenizer":
            raise
        raise TemplateError(
            f"the tokenizer ({tokenizer.name_or_path}) has no chat template (a base model?), and no other template "
            "was named.\n    fix: pass --template none to give prompts as plain text, or --template with a built-in "
            f"({', '.join(BUILTIN)}) or a .jinja file"
        ) from None


def encode(prompt: Prompt, tokenizer, jinja: str | None, processor=None) -> list[int]:
    """Token ids the model continues: the conversation with the generation prompt, or the raw text. A prompt with
    images goes through the model's `processor` (load_processor), which expands each image into its tokens."""
    from finetune.data.masking import tokenize_prompt

    if prompt.images:
        from finetune import vision

        if processor is None or jinja is None:
            raise DataError(
                f"{prompt.origin}: the prompt has images, which "
                + (
                    "need the conversation's chat template.\n    fix: drop --template none"
                    if processor is not None
                    else "need a vision-language model with its processor files.\n    fix: generate with such a "
                    "model, or leave the images out"
                )
            )
        try:
            return vision.tokenize_prompt(list(prompt.messages), list(prompt.images), processor, jinja)
        except DataError as e:
            raise DataError(f"{prompt.origin}: {e}") from None
    if jinja is None:
        if prompt.text is None:
            raise DataError(
                f"{prompt.origin}: the prompt is a conversation, which needs a chat template.\n    fix: drop "
                "--template none, or give the prompt as text"
            )
        return list(tokenizer(prompt.text)["input_ids"])
    try:
        return tokenize_prompt(list(prompt.messages), tokenizer, jinja)
    except DataError as e:  # TemplateError included
        raise DataError(f"{prompt.origin}: {e}") from None


# ---------------------------------------------------------------- a data file
def _from_file(spec: PromptSpec) -> PromptSet:
    from finetune.config.schema import DatasetSpec
    from finetune.data.sources import load_source

    ds, _ = load_source(DatasetSpec(path=spec.path, format="prompt_only"))
    columns = [c for c in ds.column_names if c != ORIGIN]
    field = _prompt_field(spec, columns)
    reference = _reference_field(spec, columns, field)
    records = ds.to_list()[: spec.samples] if spec.samples else ds.to_list()
    ids = _ids(records, spec.id_field, spec.path)
    prompts = [_file_prompt(i, ids[i], r, field, reference, spec.system) for i, r in enumerate(records)]
    return PromptSet(prompts, None, spec.path)


def load_processor(source, prompts: list[Prompt]):
    """The model's processor when a prompt has images (None otherwise): from the run's or adapter's saved files, else
    the model's; FtError naming a prompt with images when the model has none."""
    if not any(p.images for p in prompts):
        return None
    from finetune.artifacts import find_processor
    from finetune.errors import FtError

    processor = find_processor([Path(d) for d in source.tokenizer_dirs], source.model, source.trust_remote_code)
    if processor is None:
        first = next(p for p in prompts if p.images)
        raise FtError(
            f"{first.origin}: the prompt has images, but {source.describe()} has no image processor (a text model, or "
            "a vision-language model saved without preprocessor_config.json/processor_config.json).\n    fix: "
            "generate with a vision-language model's folder, or leave the images out"
        )
    return processor


def _prompt_field(spec: PromptSpec, columns: list[str]) -> str:
    if spec.prompt_field is not None:
        if spec.prompt_field not in columns:
            raise DataError(
                f"{spec.path}: no column {spec.prompt_field!r} (--prompt-field); columns: {', '.join(columns)}"
            )
        return spec.prompt_field
    found = next((f for f in PROMPT_FIELDS if f in columns), None)
    if found is None:
        raise DataError(
            f"{spec.path}: no prompt column; looked for {', '.join(PROMPT_FIELDS)}; columns: {', '.join(columns)}\n"
            "    fix: name the column with --prompt-field"
        )
    return found


def _reference_field(spec: PromptSpec, columns: list[str], prompt_field: str) -> str | None:
    if spec.reference_field is not None:
        if spec.reference_field not in columns:
            raise DataError(
                f"{spec.path}: no column {spec.reference_field!r} (--reference-field); columns: {', '.join(columns)}"
            )
        return spec.reference_field
    return next((f for f in REFERENCE_FIELDS if f in columns and f != prompt_field), None)


def _file_prompt(index: int, id_, record: dict, field: str, reference_field: str | None, system: str | None) -> Prompt:
    from finetune.config.schema import DatasetSpec
    from finetune.data.formats import RecordError, normalize

    origin = record.pop(ORIGIN)
    value = record.get(field)
    if (
        field == "instruction"
        and isinstance(value, str)
        and isinstance(record.get("input"), str)
        and record["input"].strip()
    ):
        value = f"{value}\n\n{record['input']}"  # alpaca records, as the instruction format reads them
    images = {k: record[k] for k in ("images", "image") if k in record and k != field}
    try:
        canonical = normalize(
            {field: value, **images, ORIGIN: origin},
            DatasetSpec(path=origin, format="prompt_only", columns={"prompt": field}, system_prompt=system),
        )
    except RecordError as e:
        raise DataError(f"{origin}: {e}") from None
    messages, reference = _split_answer(canonical["prompt"], origin)
    single = messages[0]["content"] if len(messages) == 1 and messages[0]["role"] == "user" else None
    text = value if isinstance(value, str) else single
    if reference is None and reference_field is not None and record.get(reference_field) is not None:
        reference = str(record[reference_field])
    return Prompt(index, id_, origin, record, tuple(messages), text, reference, tuple(canonical["images"]))


def _split_answer(messages: list[dict], origin: str) -> tuple[list[dict], str | None]:
    """(prompt messages, the final assistant message's text or None)."""
    if messages[-1]["role"] != "assistant":
        return messages, None
    if len(messages) == 1:
        raise DataError(f"{origin}: the conversation holds only an assistant message, so there is no prompt to answer")
    return messages[:-1], messages[-1]["content"]


def _ids(records: list[dict], id_field: str, where: str) -> list:
    """The id column's values (all present, unique), or positions when no record has the column."""
    if not any(r.get(id_field) is not None for r in records):
        return list(range(len(records)))
    seen: dict = {}
    for r in records:
        value = r.get(id_field)
        if value is None:
            raise DataError(
                f"{r[ORIGIN]}: no {id_field!r}, though other records have one.\n    fix: give every record an "
                "id, or none (ids are then positions)"
            )
        key = id_key(value)
        if key in seen:
            raise DataError(
                f"{r[ORIGIN]}: the id {value!r} was already used at {seen[key]}.\n    fix: make the ids unique"
            )
        seen[key] = r[ORIGIN]
    return [r[id_field] for r in records]


# ---------------------------------------------------------------- a job file's dataset
def _from_job(spec: PromptSpec) -> PromptSet:
    from finetune.config import load
    from finetune.data.sources import load_source

    config = load(spec.path)
    key, source = _job_dataset(config.data, spec)
    if source.format == "completion":
        raise DataError(
            f"{spec.path}: {key} holds completion data (plain text), which has no prompts.\n    fix: choose "
            "another dataset with --dataset"
        )
    ds, _ = load_source(source)
    records = ds.to_list()[: spec.samples] if spec.samples else ds.to_list()
    ids = _ids(records, spec.id_field, source.path)
    prompts = [_job_prompt(i, ids[i], r, source) for i, r in enumerate(records)]
    return PromptSet(
        prompts,
        NO_TEMPLATE if source.format == "prompt_completion" else config.data.template,
        f"{spec.path} ({key}: {source.path})",
    )


def _job_dataset(data, spec: PromptSpec):
    from finetune.config.schema import DatasetSpec

    choice = spec.dataset
    if choice in (None, "validation") and isinstance(data.validation, DatasetSpec):
        return "data.validation", data.validation
    if choice == "validation":
        raise DataError(
            f"{spec.path}: data.validation is not a dataset of its own.\n    fix: choose one of data.datasets "
            "with --dataset 0"
        )
    index = int(choice) if choice is not None and str(choice).isdigit() else (0 if choice is None else -1)
    if not 0 <= index < len(data.datasets):
        raise DataError(
            f"{spec.path}: --dataset {choice}: expected `validation` or an index 0..{len(data.datasets) - 1} "
            "into data.datasets"
        )
    return f"data.datasets[{index}]", data.datasets[index]


def _job_prompt(index: int, id_, record: dict, source) -> Prompt:
    from finetune.data.formats import RecordError, normalize

    origin = record[ORIGIN]
    try:
        canonical = normalize(dict(record), source)
    except RecordError as e:
        raise DataError(f"{origin}: {e}") from None
    fields = {k: v for k, v in record.items() if k != ORIGIN}
    fmt = source.format
    if fmt == "prompt_completion":
        text = canonical["prompt"]
        return Prompt(index, id_, origin, fields, ({"role": "user", "content": text},), text, canonical["completion"])
    if fmt == "preference":
        return Prompt(index, id_, origin, fields, tuple(canonical["prompt"]), None, canonical["chosen"][-1]["content"])
    if fmt == "unpaired":  # a desirable completion is a reference answer; an undesirable one is none
        reference = canonical["completion"][-1]["content"] if canonical["label"] else None
        return Prompt(index, id_, origin, fields, tuple(canonical["prompt"]), None, reference)
    images = tuple(canonical.get("images") or ())
    if fmt == "prompt_only":
        reference = next((str(record[f]) for f in REFERENCE_FIELDS if record.get(f) is not None), None)
        return Prompt(index, id_, origin, fields, tuple(canonical["prompt"]), None, reference, images)
    messages, reference = _split_answer(canonical["messages"], origin)
    return Prompt(index, id_, origin, fields, tuple(messages), None, reference, images)
