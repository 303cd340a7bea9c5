"""Without hub access (a cluster's compute nodes): a model name that is neither local nor cached fails at the first
attempt, with one message that names it and the fixes, instead of huggingface_hub's ~28 s of printed retries; one that
is cached still loads. The hub is an endpoint under .invalid, a name that never resolves: nothing is contacted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow  # each test starts ft in a process of its own (huggingface_hub reads HF_ENDPOINT once)
NOWHERE = "http://ft-no-such-host.invalid"
JOB = """model: {{name: {name}}}
data:
  datasets: [{{path: {data}, format: chat}}]
  seq_len: 64
method: {{name: sft}}
adapter: {{type: lora}}
train: {{global_batch_size: 8, max_steps: 10}}
output: {{dir: {out}}}
"""


def without_hub(tmp_path) -> dict:
    """The environment of a machine whose hub endpoint does not resolve, with an empty cache of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    return {**env, "HF_ENDPOINT": NOWHERE, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub")}


def plan(tmp_path, name: str) -> subprocess.CompletedProcess:
    """`ft plan` of a job naming `name` on a machine without the hub (bench/offline_lookup_bench.py times it)."""
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(name=name, data=REPO / "examples/data/arithmetic.jsonl", out=tmp_path / "run"))
    cmd = [sys.executable, "-m", "finetune", "plan", str(job), "--hardware", "cpu"]
    return subprocess.run(cmd, env=without_hub(tmp_path), capture_output=True, text=True, timeout=120, cwd=REPO)


def test_an_unknown_model_without_the_hub_is_answered_at_once_with_the_fix(tmp_path):
    done = plan(tmp_path, "some-org/no-such-model-xyz")
    assert done.returncode != 0
    err = done.stderr
    assert "Retry" not in err and "thrown while requesting" not in err  # none of huggingface_hub's retry lines
    assert err.count("some-org/no-such-model-xyz") >= 1 and err.count("error:") == 1  # said once
    assert "the hub cannot be reached from here (http://ft-no-such-host.invalid: " in err
    assert "a local folder with its config.json" in err and "HF_HUB_OFFLINE=1" in err and "HF_ENDPOINT" in err


def test_a_cached_model_is_planned_without_the_hub(tmp_path):
    snapshot = tmp_path / "hub" / "models--some-org--cached-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "max_position_embeddings": 256,
    }
    (snapshot / "config.json").write_text(json.dumps(config))
    done = plan(tmp_path, "some-org/cached-model")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Retry" not in done.stderr and "some-org/cached-model" in done.stdout


def test_a_tokenizer_without_the_hub_fails_at_once_naming_the_model(tmp_path):
    """A catalog model plans without the hub; its tokenizer (ft preprocess, ft train) is the first file it needs."""
    code = (
        "from finetune.config.schema import ModelSection\nfrom finetune.models import load_tokenizer\n"
        "load_tokenizer(ModelSection(name='Qwen/Qwen2.5-0.5B'))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=without_hub(tmp_path), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode != 0
    assert "Retry" not in done.stderr
    assert "model.name: 'Qwen/Qwen2.5-0.5B' is not a local folder and not in the local cache" in done.stderr
    assert f"the hub ({NOWHERE}) cannot be reached" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr


def test_a_hub_id_for_ft_generate_fails_at_once_and_ft_tiny_asks_no_hub(tmp_path):
    code = (
        "from finetune.artifacts.sources import resolve\nprint(resolve('ft-tiny').model)\n"
        "resolve('some-org/no-such-model-xyz')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=without_hub(tmp_path), capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode != 0 and "ft-tiny" in done.stdout  # ft's own tiny model: a folder, no hub
    assert "Retry" not in done.stderr
    assert "the model argument: 'some-org/no-such-model-xyz' is not a local folder and not in the local cache" in (
        done.stderr
    )
    assert f"the hub ({NOWHERE}) cannot be reached" in done.stderr
