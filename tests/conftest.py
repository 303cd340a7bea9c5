"""Shared test setup: never reach the hub; helpers to write job files."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent

MINIMAL = """\
model: {name: meta-llama/Llama-3.1-8B}
data:
  datasets: [{path: data/train.jsonl, format: chat}]
  seq_len: 2048
  packing: true
method: {name: sft}
adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}
quantization: {type: auto}
train:
  global_batch_size: 32
  micro_batch_size: auto
  gradient_checkpointing: auto
  optimizer: adamw_torch
  precision: auto
  lr: 2.0e-4
  max_steps: 1000
distributed: {backend: auto, sharding: auto, offload: auto}
output: {dir: runs/llama8b-lora}
"""


@pytest.fixture
def write_yaml(tmp_path):
    """write_yaml(text) -> path of a job file holding the dedented text."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture(scope="session")
def one_process(tmp_path_factory):
    """The run multi-process tests compare with (tests/test_distributed.py `job`): full fine-tuning in one
    process, 6 steps, a checkpoint at step 3 (saving changes nothing in the trajectory)."""
    from tests.test_distributed import ft_train, job

    tmp = tmp_path_factory.mktemp("reference")
    r = ft_train(job(tmp, "one"), "--hardware", "cpu", "--set", "output.save_steps=3")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "one"


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu are skipped where no CUDA GPU is present (CI, this project's CPU machines)."""
    import importlib.util

    has_gpu = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        has_gpu = torch.cuda.is_available()
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def run_probe(script: Path, out: Path, configs: list[str], *flags: str, timeout: int = 600) -> list[dict]:
    """A probe script (tests/scripts/*_probe.py) on 2 gloo ranks over the given job files; its JSON reports,
    one per job and rank, in (job, rank) order."""
    import json
    import os
    import subprocess
    import sys

    from tests.test_distributed import free_port

    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(script),
        "cpu:2",
        str(out),
        *configs,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("probe-*-rank*.json"))]


def random_llama(
    folder: Path,
    *,
    hidden: int,
    layers: int,
    intermediate: int,
    heads: int,
    tied: bool = False,
    kv_heads: int | None = None,
) -> int:
    """Save a Llama with random bf16 weights (uniform, norms at 1) and ft's tiny tokenizer; returns its parameter count.
    Built on the meta device and then filled: seconds even at 400M parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave each name its own tensor
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.ndim == 1 else p.uniform_(-0.05, 0.05, generator=gen)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())
