"""GRPO's trained reward models as the planner sees them: each one's config.json checked before any weight loads (a
sequence classifier with one output and a pad id), and its architecture for the memory estimate. The rewards
themselves are methods/reward_model.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from finetune.errors import FtError


def _looks_like_hub_id(model: str) -> bool:
    return not model.startswith((".", "/", "~", "\\")) and model.count("/") <= 1


@functools.lru_cache(maxsize=32)
def _read_config(model: str, revision: str, stamp: int) -> dict:
    """config.json of a local folder or hub id (stamp: the local file's mtime, so that a rewritten one is read again);
    no Python code of the model runs."""
    folder = Path(model).expanduser()
    if folder.exists():
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(model, "config.json", revision=revision)).read_text(encoding="utf-8"))


def classifier_config(spec, index: int) -> dict:
    """The checked config.json of the reward model at method.rewards[index]: a sequence classifier with one output and
    a pad id. FtError naming the key otherwise."""
    key = f"method.rewards[{index}].model"
    folder = Path(spec.model).expanduser()
    if folder.exists() and not (folder / "config.json").is_file():
        raise FtError(
            f"{key}: {spec.model} has no config.json, so it is not a saved model; give the folder a reward model was "
            "saved to (ft's `reward` method writes RUN/final)"
        )
    if not folder.exists() and not _looks_like_hub_id(spec.model):
        raise FtError(f"{key}: there is no folder {spec.model}; correct the path (e.g. runs/rm/final) or give a hub id")
    stamp = (folder / "config.json").stat().st_mtime_ns if folder.exists() else 0
    try:
        config = _read_config(spec.model, spec.revision, stamp)
    except Exception as e:  # noqa: BLE001 - every way of not finding it means the same to the user
        raise FtError(
            f"{key}: cannot read the config.json of {spec.model!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); give a local folder of a saved reward model, or a hub id that is in "
            "the cache or reachable"
        ) from None
    problems = classifier_problems(config)
    if problems:
        raise FtError(f"{key}: {spec.model} " + "; ".join(problems))
    return config


def classifier_problems(config: dict) -> list[str]:
    """What makes a config.json unfit for a reward model, each with its fix (no weights are read)."""
    found = []
    architectures = config.get("architectures") or []
    if architectures and not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        found.append(
            f"is a {', '.join(map(str, architectures))}, not a sequence classifier; give a reward model (train one "
            "with method: {name: reward} on preference data and give its RUN/final)"
        )
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2  # transformers' default is 2
    if labels != 1:
        found.append(
            f"has {labels} outputs (num_labels/id2label in config.json); a reward model has exactly one score "
            "(num_labels: 1)"
        )
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if text.get("pad_token_id") is None and config.get("pad_token_id") is None:
        found.append(
            "sets no pad_token_id in config.json, which a sequence classifier needs to find each row's last token; "
            "set pad_token_id there (to its tokenizer's pad id, or the eos id)"
        )
    return found


def classifier_facts(spec, index: int):
    """The reward model's architecture (ModelFacts) for the planner, from its checked config.json."""
    from finetune.catalog import from_hf_config

    try:
        return from_hf_config(classifier_config(spec, index), spec.model)
    except ValueError as e:
        raise FtError(f"method.rewards[{index}].model: {e}") from None
