"""Benchmark `ft preprocess` on a generated 100k-record chat set.

Prints records/s and tokens/s with num_proc 1 and 2 (same run, same data, so compare the ratio), and
packing efficiency against padding (to seq_len, and to the longest sample of each micro-batch).

    python bench/preprocess_bench.py [--records 100000] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn conversations of varied length."""
    rng = random.Random(seed)
    words = (
        "the model learns to add numbers and answer questions about text data while training on small examples".split()
    )
    out = []
    for _ in range(n):
        msgs = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            msgs.append(
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) + "?"}
            )
            msgs.append(
                {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(rng.randint(2, 80))) + "."}
            )
        out.append({"messages": msgs})
    return out


def run(records: int, seq_len: int) -> None:
    from finetune.config import loads
    from finetune.data.packing import padding_efficiency
    from finetune.data.preprocess import prepare

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chat.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(records)))
        print(f"{records:,} chat records, seq_len {seq_len}, tokenizer ft-tiny")
        results = {}
        for num_proc in (1, 2):
            cfg = loads(f"""
model: {{name: ft-tiny}}
data:
  datasets: [{{path: {data}, format: chat}}]
  seq_len: {seq_len}
  packing: true
  num_proc: {num_proc}
  cache_dir: {tmp}/cache-{num_proc}
output: {{dir: {tmp}/run}}
""")
            start = time.perf_counter()
            prepared = prepare(cfg)
            seconds = time.perf_counter() - start
            s = prepared.summary
            results[num_proc] = seconds
            print(
                f"num_proc={num_proc}: {seconds:6.1f} s  {s['records_read'] / seconds:9,.0f} records/s  "
                f"{s['tokens_per_epoch'] / seconds:11,.0f} tokens/s"
            )
        print(f"speed-up num_proc 2 vs 1: {results[1] / results[2]:.2f}x")
        lengths = [len(r) for r in prepared.train["input_ids"]]  # packed rows
        unpacked = prepared.summary
        print(
            f"tokens: {unpacked['tokens_per_epoch']:,} in {unpacked['train_samples']:,} samples (p50 "
            f"{unpacked['token_lengths']['p50']}, p99 {unpacked['token_lengths']['p99']})"
        )
        print(
            f"packing efficiency (real tokens / slots): {100 * unpacked['packing_efficiency']:.1f}% in "
            f"{len(lengths):,} rows"
        )
        print(f"padding to seq_len:                      {100 * unpacked['padding_efficiency']:.1f}%")
        sample_lengths = _sample_lengths(prepared)
        for mb in (8, 32):
            print(f"padding to longest in micro-batch of {mb:>2}:  {100 * padding_efficiency(sample_lengths, mb):.1f}%")


def _sample_lengths(prepared) -> list[int]:
    out = []
    for seq_lens in prepared.train["seq_lens"]:
        out.extend(seq_lens)
    random.Random(0).shuffle(out)  # training order is shuffled
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    run(args.records, args.seq_len)
