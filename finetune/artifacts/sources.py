"""What a SOURCE argument names: a run folder, a full model folder, a peft adapter folder, a hub id or ft-tiny.

`find_adapter` finds an adapter (`ft merge-lora`): an adapter folder, or a run folder whose final/ is one.
`resolve` finds a model to run (`ft generate`, `ft eval`): any of the above, an adapter with its base.
An adapter's base comes from --base, else the run's model.name, else the adapter's adapter_config.json; a run whose
model.name and adapter_config.json name different models is refused (`finetune.artifacts.bases`).
Nothing here reads trust_remote_code from a saved file: a folder may come from anyone, so only the
invocation (--trust-remote-code) turns it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.artifacts import bases
from finetune.artifacts.run import RunFolder, json_object
from finetune.errors import FtError

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterSource:
    """A peft adapter folder, and the run folder it is the final/ of (None for a bare adapter folder)."""

    adapter: Path
    run: Path | None
    run_config: dict  # RUN/config.yaml as written by ft train ({} for an adapter folder)
    run_plan: dict  # RUN/plan.json: the resolved adapter/quantization when the config said auto ({} when absent)
    tokenizer_dirs: tuple[Path, ...]  # where to look for the tokenizer, in order
    written_base: str | None = None  # model.name as config.yaml writes it: `${VAR}` where no value was recorded

    @property
    def qlora(self) -> bool:
        """True when the run trained on a 4-bit base: config.yaml says so, or plan.json resolved auto to it."""
        adapter = str((self.run_config.get("adapter") or {}).get("type", ""))
        quant = str((self.run_config.get("quantization") or {}).get("type", ""))
        return "qlora" in (adapter, self.run_plan.get("adapter")) or "nf4" in (quant, self.run_plan.get("quantization"))

    @property
    def scores(self) -> bool:
        """True for an adapter of a reward model (peft task SEQ_CLS): its base is loaded as a sequence classifier."""
        return json_object(self.adapter / "adapter_config.json").get("task_type") == "SEQ_CLS"

    @property
    def template(self) -> str:
        """The run's data.template (`tokenizer` for a bare adapter folder or a run that set none)."""
        return str((self.run_config.get("data") or {}).get("template") or "tokenizer")

    def base(self, override: str | None = None) -> tuple[str, str]:
        """(path or hub id of the base, the setting that named it): `override` (--base), else the run's model.name
        (refused when the adapter was trained on another model), else the adapter's base_model_name_or_path."""
        own = self.own_base()
        if override:
            return bases.given(str(override), own, self.adapter)
        recorded = (self.run_config.get("model") or {}).get("name")
        if recorded and self.run is not None:
            config = RunFolder(self.run).config_path
            if "${" in str(self.written_base or ""):  # an older ft's run folder: the value was not recorded
                return bases.unrecorded(str(self.written_base), str(recorded), own, self.adapter, config)
            return bases.checked(str(recorded), f"model.name in {config}", own, self.adapter)
        if not own:
            raise FtError(
                f"{self.adapter}: the adapter does not name its base model.\n    fix: pass --base with the folder "
                "or hub id of the model it was trained on"
            )
        return bases.base_path(own, f"base_model_name_or_path in {self.adapter / 'adapter_config.json'}")

    def own_base(self) -> str:
        """The base the adapter names itself (base_model_name_or_path in adapter_config.json); "" when it names none."""
        return str(json_object(self.adapter / "adapter_config.json").get("base_model_name_or_path") or "")


def find_adapter(source: str | Path) -> AdapterSource:
    """The adapter an adapter folder or a run folder (config.yaml + final/) holds; anything else is an FtError."""
    src = Path(source).expanduser()
    if not src.is_dir():
        raise FtError(
            f"{src}: no such folder.\n    fix: pass an adapter folder (adapter_config.json + "
            "adapter_model.safetensors) or an ft run folder (config.yaml + final/)"
        )
    run = RunFolder(src)
    if run.config_path.is_file() and run.final.is_dir():
        return _run_adapter(run)
    if (src / "adapter_config.json").is_file() or any((src / f).is_file() for f in ADAPTER_FILES):
        check_adapter_folder(src, "the adapter folder")
        return AdapterSource(adapter=src, run=None, run_config={}, run_plan={}, tokenizer_dirs=(src,))
    if (src / "config.json").is_file():
        raise FtError(
            f"{src} holds config.json and no adapter_config.json: it is a full model, there is nothing to "
            "merge.\n    fix: pass the adapter folder (or the run folder) and give this model as --base"
        )
    found = ", ".join(sorted(p.name for p in src.iterdir())[:8]) or "nothing"
    raise FtError(
        f"{src} is neither an adapter folder nor an ft run folder (it holds: {found}).\n"
        "    expected: an adapter folder with adapter_config.json + adapter_model.safetensors,\n"
        "              or a run folder with config.yaml and final/ (the adapter saved by ft train)"
    )


def _run_adapter(run: RunFolder) -> AdapterSource:
    cfg, plan = run.config_dict(unset_ok=(("model", "name"),)), run.plan_dict()
    if "full" in (str((cfg.get("adapter") or {}).get("type", "")), plan.get("adapter")):
        raise FtError(
            f"{run.path}: this run trained all weights; {run.final} is already a full model, there is nothing to merge"
        )
    check_adapter_folder(run.final, "the run's final folder")
    tok = (cfg.get("model") or {}).get("tokenizer")
    dirs = [run.final] + ([Path(tok)] if tok and Path(tok).is_dir() else [])
    written = (run.written_config().get("model") or {}).get("name")
    return AdapterSource(run.final, run.path, cfg, plan, tuple(dirs), None if written is None else str(written))


def check_adapter_folder(folder: Path, what: str) -> None:
    """FtError unless `folder` holds a peft adapter (adapter_config.json and its weights); `what` names it."""
    if not (folder / "adapter_config.json").is_file():
        hint = (
            " It holds config.json: it is a full model already, there is nothing to merge."
            if (folder / "config.json").is_file()
            else ""
        )
        raise FtError(
            f"{what} {folder} has no adapter_config.json, so it is not a peft adapter.{hint}\n    fix: point ft "
            "merge-lora at a folder saved by peft (adapter_config.json + adapter_model.safetensors) or at an ft "
            "run folder"
        )
    if not any((folder / f).is_file() for f in ADAPTER_FILES):
        raise FtError(
            f"{what} {folder} has adapter_config.json but no adapter_model.safetensors: the adapter's weights "
            "are missing.\n    fix: copy the weights next to adapter_config.json, or use a complete checkpoint"
        )


@dataclass(frozen=True)
class ModelSource:
    """A model to load: `model` alone (a full model), or `model` as the base of `adapter`."""

    model: str  # folder or hub id
    adapter: str | None
    tokenizer_dirs: tuple[str, ...]  # folders tried for the tokenizer before `model`
    template: str  # the run's data.template; `tokenizer` when not from a run
    where: str  # which setting named `model`, for messages
    trust_remote_code: bool = False  # only from this invocation (--trust-remote-code), never from a saved file

    def describe(self) -> str:
        return f"{self.adapter} on {self.model}" if self.adapter else self.model


def resolve(source: str, base: str | None = None, trust_remote_code: bool = False) -> ModelSource:
    """The ModelSource a SOURCE argument (and --base) names; FtError with the fix when it names nothing usable."""
    path = Path(source).expanduser()
    if path.is_dir():
        return _folder(path, base, trust_remote_code)
    from finetune.data.sources import looks_like_hub_id

    if not looks_like_hub_id(source):
        raise FtError(
            f"{source}: no such folder.\n    fix: pass a run folder (config.yaml + final/), a model folder "
            "(config.json), an adapter folder (adapter_config.json), a hub id or ft-tiny"
        )
    if base:
        raise FtError(
            f"--base is for adapters, but {source} names a model.\n    fix: drop --base, or pass the adapter folder"
        )
    from finetune import hub
    from finetune.config.schema import ModelSection
    from finetune.models import model_path

    where = model_path(ModelSection(name=source))  # ft-tiny: its folder
    why = "" if Path(where).exists() else hub.unreachable(source)  # one request, no retries (finetune/hub.py)
    if why and not hub.cached(source):
        raise FtError(hub.unreachable_message(source, "the model argument", why))
    return ModelSource(where, None, (), "tokenizer", "the model argument", trust_remote_code)


def _folder(path: Path, base: str | None, trust_remote_code: bool) -> ModelSource:
    run = RunFolder(path)
    if run.config_path.is_file():
        if not run.final.is_dir():
            raise FtError(
                f"{path}: the run has no final/ folder: training has not finished.\n    fix: finish it (ft train "
                "CONFIG --resume), or pass a model folder"
            )
        if not (run.final / "adapter_config.json").is_file():
            template = str(
                (run.config_dict(unset_ok=(("model", "name"),)).get("data") or {}).get("template") or "tokenizer"
            )
            _check_model_folder(run.final, f"the run's final folder {run.final}")
            return ModelSource(str(run.final), None, (), template, f"{run.final}", trust_remote_code)
        return _with_base(find_adapter(path), base, trust_remote_code)
    if (path / "adapter_config.json").is_file():
        return _with_base(find_adapter(path), base, trust_remote_code)
    _check_model_folder(path, str(path))
    if base:
        raise FtError(f"--base is for adapters, but {path} holds a full model (config.json).\n    fix: drop --base")
    return ModelSource(str(path), None, (), "tokenizer", str(path), trust_remote_code)


def _with_base(src: AdapterSource, base: str | None, trust_remote_code: bool) -> ModelSource:
    name, where = src.base(base)
    dirs = tuple(str(d) for d in src.tokenizer_dirs)
    return ModelSource(name, str(src.adapter), dirs, src.template, where, trust_remote_code)


def _check_model_folder(path: Path, what: str) -> None:
    if not (path / "config.json").is_file():
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise FtError(
            f"{what} holds neither config.json (a model) nor adapter_config.json (an adapter); it holds: {found}.\n"
            "    fix: pass a run folder (config.yaml + final/), a model folder or an adapter folder"
        )
    # unreadable: transformers' own error, when it loads the folder, says what is wrong with it
    architectures = json_object(path / "config.json").get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise FtError(
            f"{what} is a reward model ({architectures[0]}): it scores text, it does not generate.\n"
            "    fix: use it as a GRPO reward (method.rewards: [{model: ...}]), or pass a model that generates"
        )
