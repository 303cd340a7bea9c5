"""The model card `ft push` uploads as README.md: modelcard.py's card of the run, for a hub repository.

It is made from what the run folder recorded as written (config.yaml keeps secrets as `${VAR}` and nothing here
expands them; plan.json, data.json's summary, result.json's metrics), with what the hub reads from its front matter:
the base model's hub id (none when the base is a local folder or ft's built-in tiny model), the base's license (from
its own card: a local folder's README.md, or the hub cache's copy; nothing is fetched, so where neither is here the card
names none and a note says so) and the training data's hub ids.
"""

from __future__ import annotations

from pathlib import Path

from finetune.artifacts import RunFolder

ARTIFACTS = {"adapter": "adapter", "model": "model", "merged": "merged model", "gguf": "gguf"}


def push_card(run: RunFolder, kind: str, repo: str, notes: list[str]) -> str:
    """README.md for `repo`, holding the `kind` of `run` (push.KINDS); what it could not find goes to `notes`."""
    from finetune.modelcard import model_card

    config = run.written_config()
    base = str((config.get("model") or {}).get("name") or "")
    result = run.result()
    artifact = ARTIFACTS[kind]
    if kind == "model" and result.get("artifact") == "reward model":
        artifact = "reward model"
    license_ = base_license(base)
    if base and license_ is None:
        notes.append(f"the base {base}'s license was not found here (its card is not local): add it to the card")
    hub_base = base if hub_id(base) else None
    if base and hub_base is None and kind == "adapter":
        notes.append(f"the base {base} is not on the hub: others need that model to load the adapter")
    return model_card(
        {
            "config": config,
            "plan": run.plan_dict(),
            "data": run.data_summary(),
            "metrics": result,
            "artifact": artifact,
            "name": (config.get("output") or {}).get("run_name") or repo.split("/")[-1],
            "path": repo,
            "hub_base": hub_base,
            "license": license_,
            "datasets": _datasets(config),
        }
    )


def hub_id(name: str) -> bool:
    """`name` names a model on the hub: an id, not a folder here, not ft's built-in tiny models."""
    from finetune.data.sources import looks_like_hub_id
    from finetune.models import BUILT_IN

    return bool(name) and looks_like_hub_id(name) and name.lower() not in BUILT_IN and not Path(name).exists()


def base_license(base: str) -> str | None:
    """The license in the base's card (README.md front matter), read from its folder or the hub cache; None if not."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.constants import REPOCARD_NAME
    from huggingface_hub.repocard import metadata_load

    if not base:
        return None
    folder = Path(base).expanduser()
    card = folder / REPOCARD_NAME if folder.is_dir() else None
    if card is None and hub_id(base):
        cached = try_to_load_from_cache(base, REPOCARD_NAME)
        card = Path(cached) if isinstance(cached, str) else None
    if card is None or not card.is_file():
        return None
    import yaml

    try:
        meta = metadata_load(card) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None
    value = meta.get("license")
    return str(value) if value else None


def _datasets(config: dict) -> list[str]:
    """The hub ids among the job's data sets (data.datasets and data.validation paths that are no local files)."""
    data = config.get("data") or {}
    sources = list(data.get("datasets") or [])
    if isinstance(data.get("validation"), (dict, str)):
        sources.append(data["validation"])
    paths = [s.get("path") if isinstance(s, dict) else s for s in sources]
    return sorted({str(p) for p in paths if isinstance(p, str) and hub_id(p)})
