"""Which base model an adapter is loaded on, and whether two names of a base name the same model.

A run's model.name is what training loaded; the adapter's adapter_config.json names the base peft saw
(base_model_name_or_path). ft writes both from the same setting, so when they name provably different models the run
folder no longer describes its adapter (an edited config.yaml, another adapter copied into final/): an adapter on the
wrong base gives plausible-looking garbage, so that is refused. A run folder of an older ft may hold model.name as
`${VAR}` with no recorded value: there the adapter's own base is used when it is here, and ft says so.

Two names are the same model when they are the same folder (after resolving links and relative paths against this
folder), the same hub id, or a hub id and a folder of the hub's cache holding it. A hub id and some other local
folder (perhaps a save of it) cannot be told apart without reading the weights: that is not refused.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from finetune.errors import FtError

_HUB_CACHE = re.compile(r"models--([^/\\]+)--([^/\\]+)[/\\]snapshots[/\\][^/\\]+[/\\]?$")


def base_path(name: str, where: str) -> tuple[str, str]:
    """(where the base's weights are, where it was named): ft-tiny is built into ft's cache; a path must exist."""
    from finetune.models import BUILT_IN

    if name.lower() in BUILT_IN and not Path(name).exists():
        from finetune.config.schema import ModelSection
        from finetune.models import model_path

        return model_path(ModelSection(name=name)), where
    path = Path(name).expanduser()
    if (path.is_absolute() or name.startswith(".") or name.count("/") > 1) and not path.is_dir():  # not a hub id
        relative = "" if path.is_absolute() else f" in {Path.cwd()} (a relative path is read from the current folder)"
        raise FtError(
            f"{where}: the base model folder {name} does not exist{relative}.\n    fix: run from the folder it is "
            "relative to, or pass --base with the folder (config.json + safetensors) or hub id of the base"
        )
    return (str(path) if path.exists() else name), where


def identity(name: str) -> tuple[str, str]:
    """("hub", org/name) for a hub id or a snapshot folder of the hub's cache, ("folder", its real path) for a local
    folder (ft-tiny: its folder in ft's cache), ("unknown", the name) for a path that is not here."""
    from finetune.data.sources import looks_like_hub_id
    from finetune.models import BUILT_IN

    path = Path(name).expanduser()
    cached = _HUB_CACHE.search(str(path))
    if cached:
        return "hub", f"{cached.group(1)}/{cached.group(2)}".lower()
    if path.exists():
        return "folder", os.path.realpath(path)
    if name.lower() in BUILT_IN:
        return "folder", os.path.realpath(base_path(name, "the base")[0])
    return ("hub", name.lower()) if looks_like_hub_id(name) else ("unknown", name)


def same_model(a: str, b: str) -> bool | None:
    """True when the two names are provably one model, False when provably two, None when it cannot be told (a name
    is missing or not here, or a hub id meets a local folder)."""
    if not a or not b:
        return None
    if os.path.normpath(os.path.expanduser(a)) == os.path.normpath(os.path.expanduser(b)):
        return True
    (kind_a, id_a), (kind_b, id_b) = identity(a), identity(b)
    if kind_a == kind_b and kind_a != "unknown":
        return id_a == id_b
    return None


def checked(recorded: str, where: str, own: str, adapter: Path) -> tuple[str, str]:
    """The run's recorded base (`recorded`, named at `where`), refused when the adapter names another model (`own`)."""
    name, where = base_path(recorded, where)
    if same_model(name, own) is False:
        raise FtError(
            f"{where} is {recorded}, but the adapter {adapter} was trained on {own} (base_model_name_or_path in "
            f"{adapter / 'adapter_config.json'}): on another base it gives wrong outputs.\n    fix: pass --base with "
            f"the model it was trained on ({own}, or a copy of it), or correct model.name in the run's config.yaml"
        )
    return name, where


def given(base: str, own: str, adapter: Path) -> tuple[str, str]:
    """--base: used as asked; a note when the adapter names another model."""
    name, where = base_path(base, "--base")
    if same_model(name, own) is False:
        sys.stderr.write(
            f"note: --base {base} is not the model the adapter was trained on ({own}, base_model_name_or_path in "
            f"{adapter / 'adapter_config.json'}); using --base as asked\n"
        )
    return name, where


def unrecorded(written: str, now: str, own: str, adapter: Path, config: Path) -> tuple[str, str]:
    """The base of a run whose config.yaml holds model.name as `written`, a `${VAR}` whose value ft did not record
    (`now`: what it gives in this environment, still holding `${` where a variable is unset): `now` when the adapter
    names the same model or nothing, else the adapter's own base when it is here (said once), else refused."""
    where = f"model.name in {config}"
    usable = "${" not in now
    if usable and (not own or same_model(now, own)):
        return base_path(now, where)
    own_where = f"base_model_name_or_path in {adapter / 'adapter_config.json'}"
    here = " (unset here)" if not usable else f", which is {now} here"
    if own and _here(own):
        sys.stderr.write(
            f"note: {config} writes model.name as {written}{here} (this run's ft recorded no value for it); the "
            f"adapter was trained on {own} ({own_where}): using that. Pass --base to choose another base\n"
        )
        return base_path(own, own_where)
    variables = ", ".join(dict.fromkeys(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", written)))
    why = (
        f"the adapter was trained on {own} ({own_where}), which is not a folder here"
        if own
        else "the adapter names no base"
    )
    raise FtError(
        f"{config}: model.name is written as {written}{here} (this run's ft recorded no value for it), and "
        f"{why}.\n    fix: pass --base with the model the run was trained on, or "
        f"set {variables} to the value the run was started with"
    )


def _here(name: str) -> bool:
    """A folder on this machine, or the built-in ft-tiny (built on first use)."""
    from finetune.models import BUILT_IN

    return Path(name).expanduser().is_dir() or name.lower() in BUILT_IN
