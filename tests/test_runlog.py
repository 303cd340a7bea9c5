"""The run folder's records: redaction, environment snapshot (runinfo), metrics.jsonl and loss plot (metrics),
model card (modelcard), atomic writes (files)."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from finetune.errors import FtError
from finetune.files import atomic_write_text
from finetune.metrics import MetricsWriter, plot_losses, read_metrics
from finetune.modelcard import model_card
from finetune.redaction import SECRET_KEY, redact
from finetune.runinfo import environment_snapshot

HF = "hf_" + "aB3" * 12
WANDB = "0123456789abcdef" * 2 + "01234567"
AWS = "AKIA" + "ABCDEFGHIJKLMNOP"
SHA = "f" * 40


# ---------------------------------------------------------------- redact
@pytest.mark.parametrize(
    "key",
    [
        "token",
        "hf_token",
        "HF_TOKEN",
        "hub_token",
        "access_token",
        "secret",
        "client_secret",
        "password",
        "db_passwd",
        "api_key",
        "WANDB_API_KEY",
        "apikey",
        "api-key",
        "auth",
        "Authorization",
        "basic_auth",
        "credentials",
        "private_key",
        "aws_access_key",
    ],
)
def test_secret_key_names(key):
    assert SECRET_KEY.search(key)


@pytest.mark.parametrize(
    "key",
    [
        "tokenizer",
        "max_new_tokens",
        "tokens_per_step",
        "add_special_tokens",
        "pad_token",
        "eos_token",
        "pad_token_id",
        "author",
        "authors",
        "model",
        "lr",
        "revision",
    ],
)
def test_names_that_are_not_secrets(key):
    assert not SECRET_KEY.search(key)


def test_redact_nested_keys_lists_and_tuples():
    cfg = {
        "model": {"name": "m", "hub_token": "abc", "tokenizer": "t"},
        "data": {"datasets": [{"path": "p", "auth": {"user": "u", "password": "pw"}}], "add_special_tokens": ["<x>"]},
        "pair": ("a", {"api_key": "k"}),
        "n": 3,
        "use_auth_token": True,
        "token": None,
        "flag": False,
    }
    out = redact(cfg)
    assert out["model"] == {"name": "m", "hub_token": "***", "tokenizer": "t"}
    assert out["data"]["datasets"][0] == {"path": "p", "auth": "***"}
    assert out["data"]["add_special_tokens"] == ["<x>"]
    assert out["pair"] == ("a", {"api_key": "***"})
    assert (out["n"], out["use_auth_token"], out["token"], out["flag"]) == (3, True, None, False)


@pytest.mark.parametrize(
    "text, kept",
    [
        (f"token is {HF} ok", "token is *** ok"),
        (f"https://user:{HF}@huggingface.co/x", "https://user:***@huggingface.co/x"),
        ("https://u:hunter2@host:5000/path", "https://u:***@host:5000/path"),
        ("https://api.example.com/v1?token=abc123&x=1", "https://api.example.com/v1?token=***&x=1"),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload", "Authorization: Bearer ***"),
        (f"wandb key {WANDB}", "wandb key ***"),
        (f"aws {AWS}!", "aws ***!"),
        ("plain text, 2e-4, /data/train.jsonl", "plain text, 2e-4, /data/train.jsonl"),
    ],
)
def test_redact_values_inside_strings(text, kept):
    assert redact(text) == kept
    assert redact({"note": [text]}) == {"note": [kept]}


def test_redact_keeps_commit_and_revision_hashes_but_not_elsewhere():
    out = redact({"git_commit": SHA, "model": {"revision": SHA}, "note": SHA})
    assert out == {"git_commit": SHA, "model": {"revision": SHA}, "note": "***"}


def test_redact_turns_a_pydantic_model_into_a_redacted_dict():
    from pydantic import BaseModel

    class Source(BaseModel):
        path: str
        revision: str
        hub_token: str | None = None

    out = redact({"data": [Source(path="https://u:pw@example.com/d.jsonl", revision=SHA, hub_token="t")]})
    assert out == {"data": [{"path": "https://u:***@example.com/d.jsonl", "revision": SHA, "hub_token": "***"}]}


def test_redact_does_not_change_its_input():
    cfg = {"a": [{"token": "x", "s": f"Bearer {HF}"}], "b": (1, HF)}
    before = copy.deepcopy(cfg)
    out = redact(cfg)
    assert cfg == before
    assert out["a"] is not cfg["a"] and out["a"][0] is not cfg["a"][0]


# ---------------------------------------------------------------- environment
def test_environment_snapshot_keys_and_versions(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://me:hunter2@mlflow.example.com")
    monkeypatch.setenv("HF_TOKEN", HF)
    snap = environment_snapshot(tmp_path)
    for key in ("python", "platform", "cpu_count", "packages", "accelerator", "git_commit", "git_dirty", "env"):
        assert key in snap
    assert snap["packages"]["torch"] == torch.__version__
    assert set(snap["packages"]) >= {"transformers", "peft", "accelerate", "datasets", "deepspeed", "trl", "finetune"}
    assert all(isinstance(v, str) and v for v in snap["packages"].values())
    assert snap["accelerator"]["cuda"] == torch.version.cuda
    assert snap["env"]["NCCL_DEBUG"] == "INFO" and snap["env"]["OMP_NUM_THREADS"] == "4"
    assert snap["env"]["MLFLOW_TRACKING_URI"] == "https://me:***@mlflow.example.com"
    text = json.dumps(snap)
    assert HF not in text and "hunter2" not in text and "hostname" not in text
    assert socket.gethostname() not in snap.values()


def test_environment_snapshot_without_torch(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert environment_snapshot(tmp_path)["accelerator"] is None


def test_missing_package_reads_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr("finetune.runinfo.PACKAGES", ("surely-not-a-package-ft",))
    assert environment_snapshot(tmp_path)["packages"] == {"surely-not-a-package-ft": "not installed"}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_commit_inside_a_repository_and_none_outside(monkeypatch, tmp_path):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    for var in ("GIT_DIR", "GIT_WORK_TREE"):
        monkeypatch.delenv(var, raising=False)
    outside = tmp_path / "plain"
    outside.mkdir()
    snap = environment_snapshot(outside)
    assert snap["git_commit"] is None and snap["git_dirty"] is None

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], check=True, timeout=300)
    (repo / "f.txt").write_text("1")
    subprocess.run(git + ["add", "f.txt"], check=True, timeout=300)
    subprocess.run(git + ["commit", "-q", "-m", "one"], check=True, timeout=300)
    head = subprocess.run(
        git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=300
    ).stdout.strip()
    (repo / "sub").mkdir()
    snap = environment_snapshot(repo / "sub")
    assert re.fullmatch(r"[0-9a-f]{40}", snap["git_commit"]) and snap["git_commit"] == head
    assert snap["git_dirty"] is False
    (repo / "f.txt").write_text("2")
    assert environment_snapshot(repo)["git_dirty"] is True


# ---------------------------------------------------------------- metrics
def test_metrics_writer_appends_one_json_object_per_line(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.log(1, loss=2.123456789, lr=2e-4, tokens=4096)
        assert len(path.read_text().splitlines()) == 1  # flushed at once
    with MetricsWriter(path) as w:
        w.log(2, loss=1.5)
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["loss"] == 2.12346 and records[0]["lr"] == 2e-4 and records[0]["tokens"] == 4096
    assert list(records[0])[:2] == ["step", "time"] and abs(records[0]["time"] - __import__("time").time()) < 60


def test_nan_and_inf_are_written_as_null(tmp_path):
    import torch

    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.log(1, loss=float("nan"), grad_norm=math.inf, eval_loss=torch.tensor(0.25), lr=-math.inf)
    line = path.read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) | {"time": 0} == {
        "step": 1,
        "time": 0,
        "loss": None,
        "grad_norm": None,
        "eval_loss": 0.25,
        "lr": None,
    }


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for step in range(1, 8):
            w.log(step, loss=1.0 / step)
    with open(path, "a") as f:
        f.write('{"step": 8, "lo')  # the crash cut the last line short
    with MetricsWriter(path, resume_from_step=5) as w:
        for step in range(6, 9):
            w.log(step, loss=0.0)
    steps = [r["step"] for r in read_metrics(path)]
    assert steps == list(range(1, 9))
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]  # no temp file left


def test_append_after_a_cut_line_starts_a_new_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with MetricsWriter(path) as w:
        w.log(3, loss=0.5)
    with pytest.raises(FtError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(path)  # the cut line is now in the middle: reported, not silently skipped


def test_resume_from_missing_file_and_closed_writer(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl", resume_from_step=10)
    w.close()
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.log(1, loss=1.0)
    assert read_metrics(tmp_path / "absent.jsonl") == []


# ---------------------------------------------------------------- loss plot
def _write_metrics(path, eval_every=0, lr=True):
    with MetricsWriter(path) as w:
        for step in range(1, 41):
            extra = {"lr": 2e-4 * min(1, step / 5)} if lr else {}
            w.log(step, loss=2.0 / math.sqrt(step), **extra)
            if eval_every and step % eval_every == 0:
                w.log(step, eval_loss=2.2 / math.sqrt(step))


@pytest.mark.parametrize("eval_every, lr", [(0, True), (10, True), (10, False)])
def test_plot_losses_writes_a_png(tmp_path, eval_every, lr):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics, eval_every, lr)
    out = plot_losses(metrics, tmp_path / "loss.png")
    assert out == tmp_path / "loss.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl"]


def test_plot_losses_with_nothing_to_plot(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    assert plot_losses(metrics, tmp_path / "a.png") is None  # no file
    with MetricsWriter(metrics) as w:
        w.log(1, lr=1e-4, loss=float("nan"))
    assert plot_losses(metrics, tmp_path / "b.png") is None  # no finite loss
    assert not (tmp_path / "a.png").exists() and not (tmp_path / "b.png").exists()


def test_plot_losses_without_matplotlib(monkeypatch, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    _write_metrics(metrics)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(FtError, match="pip install matplotlib"):
        plot_losses(metrics, tmp_path / "loss.png")


# ---------------------------------------------------------------- model card
def _run(artifact="adapter", adapter_type="lora"):
    return {
        "config": {
            "model": {"name": "Qwen/Qwen2.5-0.5B", "revision": "main", "hub_token": HF},
            "method": {"name": "sft"},
            "adapter": {"type": "auto", "r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
            "data": {
                "datasets": [{"path": "data/train.jsonl", "format": "chat", "split": "train"}],
                "seq_len": 1024,
                "packing": True,
            },
            "train": {"lr": 2e-4, "scheduler": "cosine", "optimizer": "adamw_torch"},
        },
        "plan": {
            "model": "Qwen/Qwen2.5-0.5B",
            "hardware": "1xH100-80GB",
            "adapter": adapter_type,
            "precision": "bf16",
            "backend": "single",
            "sharding": None,
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 8,
            "world_size": 1,
            "global_batch_size": 32,
            "seq_len": 1024,
            "quantization": "none",
            "params": {"total": 494_000_000, "trainable": 1_081_344},
        },
        "data": {"train_samples": 12_345, "validation_samples": 100, "tokens_per_epoch": 3_000_000},
        "metrics": {"final_loss": 0.91234, "final_eval_loss": 1.02, "steps": 386, "seconds": 3725},
        "artifact": artifact,
        "run_dir": "runs/qwen-lora",
    }


def test_model_card_for_an_adapter():
    card = model_card(_run())
    assert card.startswith('---\nbase_model: "Qwen/Qwen2.5-0.5B"\nlibrary_name: "peft"')
    for text in (
        "`Qwen/Qwen2.5-0.5B`",
        "16 / 32",
        "q_proj, v_proj",
        "`data/train.jsonl` (format chat, split train)",
        "12,345",
        "1xH100-80GB",
        "bf16",
        "4 micro × 8 accumulation × 1 ranks = 32 sequences per step",
        "1024, packed",
        "0.9123",
        "1.0200",
        "386",
        "1h 02m 05s",
        "0.22%",
        'PeftModel.from_pretrained(base, "runs/qwen-lora/final")',
        'AutoModelForCausalLM.from_pretrained("Qwen/Qwen2.5-0.5B"',
        "ft merge-lora runs/qwen-lora",
    ):
        assert text in card, text
    assert HF not in card and "resize_token_embeddings" not in card


def test_model_card_for_a_full_model():
    run = _run(artifact="model", adapter_type="full")
    card = model_card(run)
    assert 'AutoModelForCausalLM.from_pretrained("runs/qwen-lora/final", dtype="auto")' in card
    assert "PeftModel" not in card and "merge-lora" not in card and "rank r" not in card
    assert 'library_name: "transformers"' in card and "all weights" in card


def test_model_card_with_added_tokens_and_missing_keys():
    run = _run()
    run["data"]["added_tokens"] = ["<think>"]
    assert "base.resize_token_embeddings(len(tokenizer))" in model_card(run)
    card = model_card({})
    assert "PeftModel.from_pretrained" in card and "_not recorded_" in card
    card = model_card({"config": {"model": {"name": "m"}}, "metrics": {"final_loss": float("nan")}})
    assert "`m`" in card and "nan" not in card


def test_model_card_shows_the_evaluation_results_the_run_recorded():
    run = _run(artifact="reward model")
    run["config"]["evaluation"] = {"path": "data/test.jsonl", "metric": "exact_match"}
    run["metrics"].update(
        {
            "task_before": 0.015,
            "task_after": 0.965,
            "final_metrics": {"rewards/accuracy": 0.8125},
            "final_eval_rewards/accuracy": 0.81,
            "final_eval_rewards/margin": 1.2052,
        }
    )
    card = model_card(run)
    assert "| exact_match on `data/test.jsonl` | 1.5% before, 96.5% after |" in card
    assert "| final eval rewards/accuracy | 0.81 |" in card and "| final eval rewards/margin | 1.205 |" in card
    assert "| final train rewards/accuracy | 0.8125 |" in card
    only_after = {**run, "metrics": {**run["metrics"], "task_before": None}}
    assert "| exact_match on `data/test.jsonl` | 96.5% |" in model_card(only_after)


# ---------------------------------------------------------------- atomic writes
def test_atomic_write_text(tmp_path):
    path = tmp_path / "sub" / "README.md"
    atomic_write_text(path, "one ✓")
    assert path.read_text(encoding="utf-8") == "one ✓"
    os.chmod(path, 0o600)
    atomic_write_text(path, "two")
    assert path.read_text() == "two" and (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(TypeError):
        atomic_write_text(path, b"bytes are not text")  # fails while writing
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["README.md"]


# ---------------------------------------------------------------- values read from ${VAR}
ENV_JOB = """\
model: {name: "${BASE:-ft-tiny}"}
data:
  datasets: [{path: "https://${DATA_TOKEN}@example.com/d.jsonl", format: chat}]
train: {max_steps: "${STEPS}", lr: 1.0e-3}
output: {dir: runs/x, run_name: "${RUN_SECRET}"}
"""
ENV = {"BASE": "org/private-model", "DATA_TOKEN": "opensesame123", "STEPS": "12", "RUN_SECRET": "nightly-42-secret"}


def _env_config():
    from finetune.config import loads

    return loads(ENV_JOB, environ=ENV)


def test_redact_config_records_environment_values_and_writes_secrets_back_as_references():
    from finetune.redaction import redact_config

    config = _env_config()
    out = redact_config(config, exclude_unset=True)
    assert out["model"]["name"] == "org/private-model" and out["output"]["run_name"] == "${RUN_SECRET}"
    assert out["data"]["datasets"][0]["path"] == "https://${DATA_TOKEN}@example.com/d.jsonl"
    assert out["train"]["max_steps"] == 12  # numbers are no secret; later readers need no environment
    assert "scheduler" not in out["train"] and redact(config) == redact_config(config)
    assert not any(v in json.dumps(redact(config)) for v in ("opensesame123", "nightly-42-secret"))


def test_the_saved_config_loads_again_from_the_environment():
    import yaml

    from finetune.config import loads
    from finetune.redaction import redact_config

    config = _env_config()
    saved = yaml.safe_dump(redact_config(config, exclude_unset=True), sort_keys=False)
    assert "opensesame123" not in saved
    again = loads(saved, environ=ENV)
    assert again.model_dump() == config.model_dump()
    assert set(again.env_references()) == {("data", "datasets", 0, "path"), ("output", "run_name")}  # the secrets


def test_the_model_card_shows_no_secret_from_the_environment_anywhere():
    config = _env_config()
    run = {
        "config": config,
        "plan": {"model": "org/private-model", "hardware": "cpu"},
        "data": {"sources": ["org/private-model/x"]},
        "name": "nightly-42-secret",
        "run_dir": "runs/x",
        "path": "runs/x/final",
    }
    card = model_card(run)
    assert "opensesame123" not in card and "nightly-42-secret" not in card
    assert "${RUN_SECRET}" in card and 'base_model: "org/private-model"' in card  # the base's value is recorded


def test_trackers_given_the_config_get_references_for_secrets(tmp_path, monkeypatch):
    import finetune.trackers as trk

    seen = {}

    class Sink:
        def __init__(self, run_dir, run_name, config):
            seen.update(name=run_name, config=config)

    monkeypatch.setitem(trk.MODULES, "fake", "json")
    monkeypatch.setitem(trk._SINKS, "fake", Sink)
    trk.Trackers(["fake"], tmp_path, "nightly-42-secret", _env_config())
    assert seen["name"] == "${RUN_SECRET}" and seen["config"]["model"]["name"] == "org/private-model"
    assert "opensesame123" not in json.dumps(seen["config"])
