"""A colocated vLLM engine's sleep levels on one GPU, alone (no trainer beside it): what each level gives back and
what it costs, through ft's own engine (finetune/rollout/vllm.py).

    python bench/vllm_sleep_bench.py [--size 1b] [--model DIR] [--out FILE]   (a Python with vLLM; a CUDA GPU)

The model: bench/gpu_bench.py's Llama (random bf16 weights, built offline into DIR once), and a transformers copy of
it on the same GPU, standing for the trainer. Level 1 is what a LoRA run (and a full one whose next rollout keeps the
weights) sleeps at: vLLM copies its weights to pinned host memory and back. Level 2 is a full fine-tuning run's, whose
weights are sent again at every update: vLLM drops them, and waking means loading every weight from the trainer.
One JSON line per level: GPU memory given back (freed_gib), host memory held while asleep (host_gib), seconds to
sleep, and to wake (level 2: wake and reload), and the largest log-prob gap to the awake engine's (gap: the same
weights, so ~0; a large gap means the engine computed with dropped weights). Exits 1 unless the second sleep is at
level 2, holds less than half of level 1's host memory (where level 1's shows at least 0.5 GiB) and both gaps are
under 0.05.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
GiB = 1024**3
SEQUENCES = [[5 + (7 * i + 3 * j) % 200 for j in range(48)] for i in range(4)]


def rss() -> int:
    """This process's resident memory in bytes (pinned host memory that was written counts)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def measure(engine, trainer, level: int, reference) -> dict:
    import torch

    torch.cuda.synchronize()
    free, host = torch.cuda.mem_get_info()[0], rss()
    start = time.perf_counter()
    engine.sleep(reloading=level == 2)
    asleep = time.perf_counter()
    freed, held = torch.cuda.mem_get_info()[0] - free, rss() - host
    if level == 2:  # the update wakes the engine and loads every weight in place
        engine.update(SimpleNamespace(kind="full", version=level, tensors=lambda: iter(trainer.named_parameters())))
    else:
        engine.wake()
    torch.cuda.synchronize()
    woken = time.perf_counter()
    return {
        "level": engine.sleep_level,
        "freed_gib": round(freed / GiB, 2),
        "host_gib": round(held / GiB, 2),
        "sleep_s": round(asleep - start, 3),
        "wake_s": round(woken - asleep, 3),
        "gap": round(gap(engine.score(SEQUENCES), reference), 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", help="bench/gpu_bench.py's model size: 1b or small")
    parser.add_argument("--model", default="/tmp/ft-vllm-sleep-model", help="its folder (built once)")
    parser.add_argument("--out", default="", help="also write the JSON lines here")
    args = parser.parse_args()
    import torch
    from gpu_bench import build
    from transformers import AutoModelForCausalLM

    from finetune.rollout.vllm import EngineSpec, VllmRollout, prepare_environment

    build(Path(args.model), args.size)
    prepare_environment(gpu=True)
    spec = EngineSpec(args.model, args.model, "bf16", max_model_len=256, memory_share=0.4, sleep=True)
    engine = VllmRollout(spec, stop=[])
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).to("cuda")
    reference = engine.score(SEQUENCES)
    rows = [measure(engine, trainer, level, reference) for level in (1, 2)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    print(text, end="", flush=True)
    if args.out:
        Path(args.out).write_text(text)
    one, two = rows
    kept = one["host_gib"] < 0.5 or two["host_gib"] < 0.5 * one["host_gib"]  # where host memory shows the copy
    ok = two["level"] == 2 and kept and max(one["gap"], two["gap"]) < 0.05
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
