"""What the benchmark scripts share: run `ft train` on a config as a user would, and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def train_metrics(config: Path, hardware: str, run_dir: Path) -> list[dict]:
    """metrics.jsonl rows of `ft train CONFIG --hardware HARDWARE` (one thread per process; stops on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "train", str(config), "--hardware", hardware],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def build_llama(
    folder: Path, vocab: int = 0, hidden: int = 256, layers: int = 4, tied: bool = True, max_positions: int = 2048
) -> int:
    """A random Llama with ft-tiny's tokenizer, saved to `folder` (vocab: rows of the output head, at least the
    tokenizer's; 0: exactly the tokenizer's); returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=max(vocab, len(tok)),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())
