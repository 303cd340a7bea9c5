"""`ft push RUN --repo ORG/NAME`: a run's adapter, model, merged model or GGUF files to a model repository on the hub.

What goes up (`kind`), each with ft's model card as README.md (modelcard.py) in place of any README there:
    adapter  final/ of a LoRA or QLoRA run: the peft adapter, its tokenizer and chat template (a vision-language
             model's processor files too); the default for those runs
    model    final/ of a run that trained all weights (or a reward model); the default for those runs
    merged   the adapter merged into its base: the folder --from names (one `ft merge-lora` wrote), else
             RUN/export/merged, which `ft merge-lora` writes on first use and again whenever final/ is newer
    gguf     RUN/export/gguf-KIND/: the .gguf file and the Modelfile `ft export RUN --gguf --quant KIND` writes, each
             kind's folder as it is
Files that only ft reads are left out (hidden files, locks, logs, ft's merge record with its local paths, optimizer and
trainer states), and so is a file that holds a secret: the value of a secret-named variable of this environment
(HF_TOKEN, WANDB_API_KEY, ...) or a token, key or password (redaction.leaks) stops the push before anything is sent.

`--dry-run` lists exactly what would be uploaded (path in the repository, bytes, total) and asks the hub nothing. The
upload is huggingface_hub's: `HfApi.create_repo(exist_ok=True, private=...)`, then `HfApi.upload_folder` on a staging
folder of links to the listed files (with hf_xet, a dependency of huggingface_hub, it streams, commits a large folder
in several commits, and resumes when run again: committed files are skipped). The token is huggingface_hub's own
(HF_TOKEN, else `hf auth login`'s) and is never printed.
"""

from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path

from finetune.artifacts import RunFolder, first_line
from finetune.errors import FtError

KINDS = ("adapter", "model", "merged", "gguf")
WEIGHTS = (".safetensors", ".gguf", ".bin", ".pt", ".pth")  # not read for secrets: numbers, and large
# (pattern, why it stays here): what only ft reads, never what loads the model
LEFT_OUT = (
    (".*", "hidden (ft's markers and temporary files)"),
    ("*/.*", "hidden (ft's markers and temporary files)"),
    (
        "README.md",
        "the folder's own card (a merge's record, with this machine's paths); the repository gets the one above",
    ),
    ("ft_merge.json", "ft's record of the merge, with this machine's paths"),
    ("*.lock", "a lock file"),
    ("*.log", "a log"),
    ("optimizer*", "optimizer state"),
    ("scheduler*", "scheduler state"),
    ("rng_state*", "random state"),
    ("trainer_state.json", "trainer state"),
    ("training_args.bin", "trainer state"),
)


@dataclass(frozen=True)
class PushJob:
    """What `ft push` was asked: the run, the repository, what of the run (None: the run's default), where from."""

    run: Path
    repo: str
    kind: str | None = None  # adapter | merged | gguf (--adapter, --merged, --gguf); None: adapter or model
    source: Path | None = None  # --from: a merged folder (with --merged)
    private: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class Upload:
    """One file of the push: its path in the repository, its bytes, where it is read from (None: the card)."""

    path: str
    size: int
    source: Path | None


@dataclass(frozen=True)
class PushPlan:
    """Exactly what would be uploaded where, and what was left out (path, why)."""

    repo: str
    kind: str
    folder: Path
    files: tuple[Upload, ...]
    card: str
    private: bool
    left_out: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    def lines(self) -> list[str]:
        width = max(len(f.path) for f in self.files)
        out = [f"{self.kind} from {self.folder} -> {self.repo} ({'private' if self.private else 'public'} if created)"]
        out += [f"  {f.path:<{width}}  {f.size:>15,} B" + ("  (model card)" if f.source is None else "") for f in self]
        out.append(f"  {len(self.files)} files, {self.total:,} bytes ({_human(self.total)})")
        out += [f"  left out   {path}: {why}" for path, why in self.left_out]
        out += [f"  note       {n}" for n in self.notes]
        return out

    def __iter__(self):
        return iter(self.files)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.3g} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return f"{n:.3g} TB"


# ---------------------------------------------------------------- the verb
def push(job: PushJob) -> tuple[PushPlan, str]:
    """Plan the push (and, unless a dry run, upload); (the plan, the commit's URL or "" for a dry run)."""
    check_repo(job.repo)
    from finetune import hub

    if not job.dry_run and hub.offline():
        raise FtError(
            "HF_HUB_OFFLINE is set: ft push needs the hub.\n    fix: unset HF_HUB_OFFLINE (and HF_DATASETS_OFFLINE "
            "does not matter), or pass --dry-run to list what would be uploaded"
        )
    token = None if job.dry_run else hub_token()
    plan = plan_push(job)
    if job.dry_run:
        return plan, ""
    return plan, upload(plan, token)


def check_repo(repo: str) -> None:
    """FtError naming --repo unless huggingface_hub takes `repo` for a repository id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise FtError(
            f"--repo {repo!r}: not a hub repository id ({first_line(e)})\n    fix: write it as ORG/NAME"
        ) from None


def hub_token() -> str:
    """huggingface_hub's token (HF_TOKEN, else the one `hf auth login` saved); FtError when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise FtError(
            "no Hugging Face token: ft push uploads with your account's token.\n    fix: run `hf auth login` (it saves "
            "the token for later commands), or set HF_TOKEN to a token with write access"
        )
    return token


# ---------------------------------------------------------------- what goes up
def plan_push(job: PushJob) -> PushPlan:
    """What `job` uploads: the files (sorted, with sizes), the card, what is left out; FtError when there is nothing."""
    from finetune.export.card import push_card

    run = _run(job.run)
    kind = _kind(run, job.kind, job.source)
    notes = []
    folder = _folder(run, kind, job.source, notes)
    files, left_out = _files(folder, kind)
    card = push_card(run, kind, job.repo, notes)
    plan = PushPlan(
        repo=job.repo,
        kind=kind,
        folder=folder,
        files=tuple(sorted([*files, Upload("README.md", len(card.encode()), None)], key=lambda f: f.path)),
        card=card,
        private=job.private,
        left_out=tuple(left_out),
        notes=tuple(notes),
    )
    refuse_secrets(plan)
    return plan


def _run(path: Path) -> RunFolder:
    run = RunFolder(path)
    if not run.is_run():
        raise FtError(
            f"{run.path} is not an ft run folder (no config.yaml and plan.json).\n    fix: pass the output.dir of "
            "an ft train job"
        )
    if not run.final.is_dir():
        raise FtError(
            f"{run.path}: the run has no final/ folder: training has not finished.\n    fix: finish it (ft train "
            "CONFIG --resume), then push"
        )
    return run


def _kind(run: RunFolder, asked: str | None, source: Path | None) -> str:
    adapter = (run.final / "adapter_config.json").is_file()
    if source is not None and asked != "merged":
        raise FtError("--from names a merged folder: it goes with --merged.\n    fix: add --merged, or drop --from")
    if asked is None:
        return "adapter" if adapter else "model"
    if asked not in KINDS:
        raise FtError(f"{asked!r} is not something ft push uploads: one of {', '.join(KINDS)}")
    if asked in ("adapter", "merged") and not adapter:
        raise FtError(
            f"--{asked}: {run.final} is a full model (the run trained all weights, or merged its adapter), there is "
            "no adapter.\n    fix: push it without --adapter or --merged (or --gguf for its GGUF export)"
        )
    return asked


def _folder(run: RunFolder, kind: str, source: Path | None, notes: list[str]) -> Path:
    if kind in ("adapter", "model"):
        return run.final
    if kind == "gguf":
        if not any(any(d.glob("*.gguf")) for d in run.gguf_exports):
            raise FtError(
                f"--gguf: {run.export_dir} holds no gguf-KIND/ folder with a .gguf file: the run has not been "
                f"exported.\n    fix: ft export {run.path} --gguf [--quant KIND]"
            )
        return run.export_dir  # each kind's folder goes up as it is: its Modelfile names the .gguf beside it
    if source is not None:
        return _merged_folder(Path(source).expanduser())
    return _merged_here(run, notes)


def _merged_folder(folder: Path) -> Path:
    """A folder `ft merge-lora` wrote (config.json and safetensors weights, no adapter), else FtError."""
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise FtError(
            f"--from {folder}: not a merged model (config.json and .safetensors weights).\n    fix: pass the --out "
            "folder of ft merge-lora, or drop --from to merge into RUN/export/merged"
        )
    if (folder / "adapter_config.json").is_file():
        raise FtError(f"--from {folder}: an adapter, not a merged model.\n    fix: push it with --adapter")
    return folder


def _merged_here(run: RunFolder, notes: list[str]) -> Path:
    """RUN/export/merged, merged from final/ by `ft merge-lora` when missing or older than final/."""
    out = run.merged_export
    written = out / "config.json"
    newest = max(p.stat().st_mtime for p in run.final.rglob("*") if p.is_file())
    if written.is_file() and written.stat().st_mtime >= newest:
        notes.append(f"uploading the merge ft wrote earlier to {out} (final/ has not changed since)")
        return out
    from finetune.merge import merge_lora

    report = merge_lora(run.path, out, overwrite=True)
    notes.append(f"merged final/ into its base {report.base} ({report.dtype}) in {out}")
    notes.append(f"merge check: max |logit(base+adapter) - logit(merged)| = {report.max_abs_logit_diff:.3g}")
    return out


def _files(folder: Path, kind: str) -> tuple[list[Upload], list[tuple[str, str]]]:
    """The files of `folder` that go up (and those that stay, with why), by path in the repository."""
    found, left_out = [], []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        why = _left_out(rel, kind)
        if why:
            left_out.append((rel, why))
        else:
            found.append(Upload(rel, path.stat().st_size, path))
    return found, left_out


def _left_out(rel: str, kind: str) -> str:
    if kind == "gguf" and not (fnmatch(rel, "gguf-*/*.gguf") or fnmatch(rel, "gguf-*/Modelfile")):
        return "not a gguf-KIND/ folder's .gguf file or Modelfile"
    return next((why for pattern, why in LEFT_OUT if fnmatch(rel, pattern)), "")


def refuse_secrets(plan: PushPlan) -> None:
    """FtError naming the file (never the value) when a file to upload holds a secret (redaction.leaks)."""
    from finetune.redaction import leaks

    for f in plan:
        if f.source is not None and (f.path.endswith(WEIGHTS) or f.size > 64 * 2**20):
            continue
        text = plan.card if f.source is None else f.source.read_text(errors="replace")
        found = leaks(text)
        if found:
            raise FtError(
                f"{f.path} would carry {', '.join(found)} to {plan.repo}; nothing was uploaded.\n    fix: remove it "
                f"from {f.source or 'the run config'} (ft writes secrets as ${{VAR}}), then push again"
            )


# ---------------------------------------------------------------- the upload
def upload(plan: PushPlan, token: str) -> str:
    """create_repo, then upload_folder of a staging folder holding links to exactly the plan's files; the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="ft-push-") as tmp:
        stage = Path(tmp)
        for f in plan:
            target = stage / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.source is None:
                target.write_text(plan.card)
            else:
                os.symlink(f.source.resolve(), target)
        _hub(lambda: api.create_repo(plan.repo, private=plan.private, exist_ok=True, repo_type="model"), plan.repo)
        commit = _hub(
            lambda: api.upload_folder(
                repo_id=plan.repo,
                folder_path=stage,
                repo_type="model",
                allow_patterns=[glob.escape(f.path) for f in plan],
                commit_message=f"Upload the {plan.kind} trained with ft",
            ),
            plan.repo,
        )
    return str(getattr(commit, "commit_url", "") or f"{plan.repo}")


def _hub(call, repo: str):
    """call(), its hub failures as FtErrors that say what to do (no token or traceback in them)."""
    from huggingface_hub.errors import HfHubHTTPError

    from finetune import hub
    from finetune.redaction import redact

    transport = tuple(c for c in HfHubHTTPError.__bases__ if c is not OSError)  # the HTTP client's own error
    try:
        return call()
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        fix = {
            401: "the token was refused: run `hf auth login` again, or set HF_TOKEN to a valid token",
            403: f"the token may not write to {repo}: use a token with write access to its namespace",
            404: f"check the namespace of {repo} (your user name or an organization you belong to)",
        }.get(status, "check the repository id and your access, then run ft push again (it resumes)")
        raise FtError(
            f"the hub refused the push to {repo} ({status}: {redact(first_line(e))})\n    fix: {fix}"
        ) from None
    except (OSError, *transport) as e:
        raise FtError(
            f"cannot reach the hub at {hub.endpoint()} ({type(e).__name__}: {redact(first_line(e))}); nothing more "
            f"was uploaded to {repo}.\n    fix: check the network (or HF_ENDPOINT), then run ft push again: it "
            "resumes, skipping the files already uploaded"
        ) from None
