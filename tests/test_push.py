"""ft push: what each kind lists and leaves out, the model card it writes, secrets kept out, bad repository ids, and the
refusals and messages of an upload that cannot happen (no hub here: the upload itself is not exercised, only everything
up to it, and a hub that is unreachable or refuses)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from finetune.errors import FtError
from finetune.export.push import PushJob, plan_push, push
from tests.helpers import REPO, free_port, job_text, train_here, write_job

HF_TOKEN = "hf_" + "Zq7" * 12  # fake, in the environment while the runs train and push
WANDB_KEY = "0123456789abcdef" * 2 + "89abcdef"  # 40 hex characters, as a wandb key
SECRETS = {"HF_TOKEN": HF_TOKEN, "WANDB_API_KEY": WANDB_KEY}
ADAPTER_FILES = ["README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja"]
ADAPTER_FILES += ["tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{base, lora, full}: a tiny base whose card says apache-2.0, and a 2-step LoRA run and full run on it, trained
    with the fake secrets in the environment."""
    from finetune.tiny import build_model

    root = tmp_path_factory.mktemp("push")
    build_model(root / "base")
    (root / "base" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a tiny base\n")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in SECRETS.items():
            mp.setenv(name, value)
        for kind in ("lora", "full"):
            job = write_job(root, job_text(root, kind, steps=2, out=kind), f"{kind}.yaml")
            train_here(job, "--set", f"model.name={root / 'base'}")
    return {"base": root / "base", "lora": root / "lora", "full": root / "full"}


@pytest.fixture(autouse=True)
def secrets_set(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / run.name, symlinks=True))


def _edit_config(run: Path, **keys) -> None:
    """Set dotted keys of RUN/config.yaml (as a hand edit of the run's record would)."""
    path = run / "config.yaml"
    data = yaml.safe_load(path.read_text())
    for dotted, value in keys.items():
        *parents, last = dotted.split(".")
        holder = data
        for part in parents:
            holder = holder[int(part)] if isinstance(holder, list) else holder.setdefault(part, {})
        holder[last] = value
    path.write_text(yaml.safe_dump(data))


def _listed(plan) -> dict[str, int]:
    return {f.path: f.size for f in plan}


# ---------------------------------------------------------------- what each kind lists
def test_adapter_dry_run_lists_exactly_the_adapter_and_tokenizer_with_sizes(runs, tmp_path):
    run = _copy(runs["lora"], tmp_path)
    for name in ("optimizer.pt", "train.log", ".ft-lock", "ft_merge.json"):  # only ft or training reads these
        (run / "final" / name).write_text("x")
    plan = plan_push(PushJob(run, "me/tiny-lora"))  # no kind: a LoRA run's adapter
    assert plan.kind == "adapter" and list(_listed(plan)) == ADAPTER_FILES  # sorted: the order is deterministic
    for f in plan:
        assert f.size == (len(plan.card.encode()) if f.path == "README.md" else (run / "final" / f.path).stat().st_size)
    assert plan.total == sum(_listed(plan).values())
    left = dict(plan.left_out)
    assert set(left) == {"optimizer.pt", "train.log", ".ft-lock", "ft_merge.json", "README.md"}, left
    text = "\n".join(plan.lines())
    assert f"{len(ADAPTER_FILES)} files, {plan.total:,} bytes" in text and "adapter_model.safetensors" in text
    assert plan_push(PushJob(run, "me/tiny-lora")).lines() == plan.lines()


def test_merged_dry_run_merges_once_into_the_run_and_lists_a_plain_model(runs, tmp_path):
    run = _copy(runs["lora"], tmp_path)
    plan = plan_push(PushJob(run, "me/tiny-merged", "merged"))
    assert plan.folder == run / "export" / "merged"
    listed = set(_listed(plan))
    assert {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= listed
    assert "chat_template.jinja" in listed and not any("adapter" in p for p in listed)
    assert "README.md" in dict(plan.left_out) and "this machine's paths" in dict(plan.left_out)["README.md"]
    assert any(n.startswith("merge check") for n in plan.notes)
    again = plan_push(PushJob(run, "me/tiny-merged", "merged"))  # final/ unchanged: the merge is reused
    assert _listed(again) == _listed(plan) and any("wrote earlier" in n for n in again.notes)
    card = plan.card
    assert 'library_name: "transformers"' in card and "merged into the weights of" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-merged"' in card


def test_merged_from_a_folder_and_its_refusals(runs, tmp_path):
    from finetune.merge import merge_lora

    merge_lora(runs["lora"], tmp_path / "m")
    plan = plan_push(PushJob(runs["lora"], "me/m", "merged", tmp_path / "m"))
    assert plan.folder == tmp_path / "m" and "model.safetensors" in _listed(plan)
    with pytest.raises(FtError, match="--from .* not a merged model"):
        plan_push(PushJob(runs["lora"], "me/m", "merged", runs["lora"]))
    with pytest.raises(FtError, match="--from names a merged folder: it goes with --merged"):
        plan_push(PushJob(runs["lora"], "me/m", None, tmp_path / "m"))


def test_a_full_run_pushes_its_model_and_refuses_adapter_and_merged(runs):
    plan = plan_push(PushJob(runs["full"], "me/tiny-full"))
    listed = _listed(plan)
    assert plan.kind == "model" and {"config.json", "model.safetensors", "README.md"} <= set(listed)
    assert 'library_name: "transformers"' in plan.card and "all weights" in plan.card
    for kind in ("adapter", "merged"):
        with pytest.raises(FtError, match=f"--{kind}: .* is a full model"):
            plan_push(PushJob(runs["full"], "me/tiny-full", kind))


def test_gguf_without_an_export_refuses_with_the_command(runs):
    with pytest.raises(FtError) as e:
        plan_push(PushJob(runs["full"], "me/tiny-gguf", "gguf"))
    assert f"fix: ft export {runs['full']} --gguf [--quant KIND]" in str(e.value)


def test_gguf_lists_the_gguf_files_and_the_modelfile(runs, tmp_path):
    run = Path(shutil.copytree(runs["full"], tmp_path / "run"))  # the other tests see the run unexported
    gguf = run / "export" / "gguf-q8_0"
    gguf.mkdir(parents=True, exist_ok=True)
    (gguf / "model-q8_0.gguf").write_bytes(b"GGUF" + bytes(60))
    (gguf / "Modelfile").write_text("FROM ./model-q8_0.gguf\n")
    (gguf / "ft_export.json").write_text("{}")
    (run / "export" / "merged").mkdir(exist_ok=True)
    (run / "export" / "merged" / "config.json").write_text("{}")
    (run / "export" / "notes.txt").write_text("scratch")
    plan = plan_push(PushJob(run, "me/tiny-gguf", "gguf"))
    listed = {"gguf-q8_0/Modelfile": 23, "README.md": len(plan.card.encode()), "gguf-q8_0/model-q8_0.gguf": 64}
    assert _listed(plan) == listed
    assert set(dict(plan.left_out)) == {"gguf-q8_0/ft_export.json", "merged/config.json", "notes.txt"}
    assert '"gguf"' in plan.card and "library_name" not in plan.card and "ollama create" in plan.card


# ---------------------------------------------------------------- the model card
def test_card_names_the_base_license_and_metrics(runs):
    import json

    card = plan_push(PushJob(runs["lora"], "me/tiny-lora")).card
    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "apache-2.0" and front["library_name"] == "peft" and "lora" in front["tags"]
    assert "base_model" not in front  # a local folder is no hub model
    result = json.loads((runs["lora"] / "result.json").read_text())
    assert f"| final train loss | {result['final_loss']:.4f} |" in card and "| optimizer steps | 2 |" in card
    assert f"`{runs['base']}`" in card and 'PeftModel.from_pretrained(base, "me/tiny-lora")' in card


def test_card_front_matter_for_a_hub_base_and_hub_data(runs, tmp_path):
    run = _copy(runs["lora"], tmp_path)
    _edit_config(run, **{"model.name": "org/base-model", "data.datasets.0.path": "org/some-data"})
    plan = plan_push(PushJob(run, "me/x"))
    front = yaml.safe_load(plan.card.split("---")[1])
    assert front["base_model"] == "org/base-model" and front["datasets"] == ["org/some-data"]
    assert "license" not in front and any("license was not found" in n for n in plan.notes)


def test_no_secret_reaches_the_listed_files_or_the_card(runs, tmp_path):
    run = _copy(runs["lora"], tmp_path)
    _edit_config(run, **{"output.run_name": f"run {HF_TOKEN} {WANDB_KEY}"})  # typed in clear into the record
    for kind in (None, "merged"):
        plan = plan_push(PushJob(run, "me/x", kind))
        assert "***" in plan.card  # the title held them: redacted
        for f in plan:
            data = plan.card.encode() if f.source is None else f.source.read_bytes()
            for value in SECRETS.values():
                assert value.encode() not in data, f.path


def test_a_file_holding_a_secret_stops_the_push_without_showing_it(runs, tmp_path):
    run = _copy(runs["lora"], tmp_path)
    (run / "final" / "notes.txt").write_text(f"token={HF_TOKEN}\n")
    with pytest.raises(FtError) as e:
        plan_push(PushJob(run, "me/x"))
    assert "notes.txt would carry HF_TOKEN" in str(e.value) and HF_TOKEN not in str(e.value)


# ---------------------------------------------------------------- refusals before anything is sent
@pytest.mark.parametrize("repo", ["bad name", "a/b/c", "-org/x", "org/x-", "org/" + "n" * 97, "org/x..y"])
def test_bad_repo_ids_are_refused_naming_repo(runs, repo):
    with pytest.raises(FtError, match=r"--repo .*not a hub repository id"):
        push(PushJob(runs["lora"], repo, dry_run=True))


def test_offline_mode_refuses_the_upload(runs):
    with pytest.raises(FtError, match="HF_HUB_OFFLINE is set: ft push needs the hub"):
        push(PushJob(runs["lora"], "me/x"))  # tests/conftest.py sets HF_HUB_OFFLINE=1


def _ft_push(run, *args, env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    return subprocess.run(
        [sys.executable, "-m", "finetune", "push", str(run), "--repo", "me/tiny", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**clean, "HF_HUB_OFFLINE": "0", **env},
        timeout=120,
    )


def test_dry_run_sends_nothing_and_needs_no_token(runs, tmp_path):
    with socket.socket() as hub:  # a hub that would record any connection
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        hub.setblocking(False)
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}", "HF_HOME": str(tmp_path / "hf")}
        done = _ft_push(runs["lora"], "--dry-run", env=env)
        assert done.returncode == 0, done.stderr
        with pytest.raises(BlockingIOError):
            hub.accept()  # nobody connected
    assert "dry run: nothing was uploaded" in done.stdout and "adapter_model.safetensors" in done.stdout
    assert HF_TOKEN not in done.stdout + done.stderr


def test_no_token_is_refused_with_the_login_advice(runs, tmp_path):
    done = _ft_push(runs["lora"], env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert done.returncode == 2 and "no Hugging Face token" in done.stderr and "hf auth login" in done.stderr


def test_an_unreachable_hub_is_a_clear_error_without_the_token(runs, tmp_path):
    env = {"HF_TOKEN": HF_TOKEN, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf")}
    done = _ft_push(runs["lora"], "--private", env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "cannot reach the hub at http://127.0.0.1" in out and "run ft push again: it resumes" in out
    assert "Traceback" not in out and HF_TOKEN not in out


class _Refusing(BaseHTTPRequestHandler):
    """A hub that answers every request 401, as the hub does for a revoked token."""

    def _refuse(self):
        body = b'{"error": "Invalid credentials in Authorization header"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_HEAD = _refuse

    def log_message(self, *args):
        pass


def test_a_refused_token_is_a_clear_error_without_the_token(runs, tmp_path):
    server = HTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"HF_TOKEN": HF_TOKEN, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        done = _ft_push(runs["lora"], env={**env, "HF_HOME": str(tmp_path / "hf")})
    finally:
        server.shutdown()
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "the hub refused the push to me/tiny (401" in out, out
    assert "hf auth login" in out and "Traceback" not in out and HF_TOKEN not in out
