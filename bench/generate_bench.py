"""Generation throughput of `ft generate`: 1 vs 2 processes, length-sorted vs unsorted batches, in one run.

A small Llama (built here; random weights, so completions seldom end before --max-new-tokens) answers
prompts whose lengths vary from a few words to a few hundred tokens. Each configuration is a real
`ft generate` job with one thread per process (2 processes are started through torchrun), so 2
processes use twice the cores of 1. prompts/s and tokens/s count the generation phase (the first
process starting to generate to the last one finishing; imports and model loading excluded); wall is
the whole job. Configurations are interleaved over --repeats rounds and the best round is kept.
Compare the ratios, not the absolute figures.

    python bench/generate_bench.py [--prompts 96] [--max-new-tokens 32] [--batch-size 8] [--repeats 2]
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
os.environ["OMP_NUM_THREADS"] = "1"  # one thread per process: 2 processes use the 2 cores, 1 process one of them

import torch  # noqa: E402
from common import build_llama  # noqa: E402

torch.set_num_threads(1)

CONFIGS = [
    ("1 process, sorted", 1, True),
    ("1 process, unsorted", 1, False),
    ("2 processes, sorted", 2, True),
    ("2 processes, unsorted", 2, False),
]


def build_model(folder: Path) -> int:
    return build_llama(folder)


def write_prompts(path: Path, n: int) -> None:
    rng = random.Random(0)
    words = (
        "the model learns to add numbers and answer questions about text data while training on small examples".split()
    )
    with open(path, "w") as f:
        for i in range(n):
            length = int(rng.lognormvariate(3.2, 1.0)) + 3  # mostly short, a long tail, as real prompt sets are
            f.write(
                json.dumps({"id": i, "prompt": " ".join(rng.choice(words) for _ in range(min(length, 400)))}) + "\n"
            )


def run(tmp: Path, name: str, processes: int, sort: bool, args) -> dict:
    from finetune.artifacts import resolve
    from finetune.infer.engines import Sampling
    from finetune.infer.generate import GenerateJob, generate
    from finetune.infer.prompts import PromptSpec

    out = tmp / f"{name.replace(' ', '_').replace(',', '')}.jsonl"
    job = GenerateJob(
        resolve(str(tmp / "model")),
        PromptSpec(str(tmp / "prompts.jsonl")),
        str(out),
        Sampling(max_new_tokens=args.max_new_tokens),
        batch_size=args.batch_size,
        sort=sort,
        engine="transformers",
    )
    start = time.perf_counter()
    result = generate(job, processes=processes, overwrite=True, progress=False)
    wall = time.perf_counter() - start
    return {
        "pps": result.prompts_per_s,
        "tps": result.tokens_per_s,
        "wall": wall,
        "padding": result.padding,
        "tokens": result.tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        params = build_model(tmp / "model")
        write_prompts(tmp / "prompts.jsonl", args.prompts)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, processes, sort in CONFIGS:
                r = run(tmp, name, processes, sort, args)
                if name not in best or r["tps"] > best[name]["tps"]:
                    best[name] = r
        outputs = {
            name: (tmp / f"{name.replace(' ', '_').replace(',', '')}.jsonl").read_bytes() for name, _, _ in CONFIGS
        }
    base = best[CONFIGS[0][0]]
    print(
        f"ft generate: Llama {params / 1e6:.1f} M parameters, {args.prompts} prompts, {args.max_new_tokens} new "
        f"tokens each, batch {args.batch_size}, greedy, CPU, best of {args.repeats}"
    )
    print(f"  {'':<24}{'prompts/s':>10}{'tokens/s':>10}{'ratio':>7}{'wall s':>8}{'padding':>9}")
    for name, _, _ in CONFIGS:
        r = best[name]
        print(
            f"  {name:<24}{r['pps']:>10.2f}{r['tps']:>10,.0f}{r['tps'] / base['tps']:>6.2f}x"
            f"{r['wall']:>8.1f}{100 * r['padding']:>8.0f}%"
        )
    print(
        "  sorted vs unsorted, 1 process: "
        f"{best['1 process, sorted']['tps'] / best['1 process, unsorted']['tps']:.2f}x;"
        f" 2 vs 1 process, sorted: {best['2 processes, sorted']['tps'] / base['tps']:.2f}x"
    )
    same = (
        outputs["1 process, sorted"] == outputs["2 processes, sorted"]
        and outputs["1 process, unsorted"] == outputs["2 processes, unsorted"]
    )
    print(f"  outputs of 1 and 2 processes byte-identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
