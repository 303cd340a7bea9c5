"""GRPO throughput of the tiny model: optimizer steps/s and generated tokens/s, 1 process vs 2 (DDP), CPU/gloo.

    python bench/grpo_bench.py [--steps 20] [--generations 8] [--max-new-tokens 16]

Each run is a real `ft train` on prompt-only arithmetic data (2 processes: ft starts them through
torchrun, OMP_NUM_THREADS=1). From metrics.jsonl: seconds per step (median over steps after the first
two), the share of it spent generating (rollout_s), and generated tokens per second of rollout, summed
over ranks. On a 2-core machine two processes share the cores one process had: compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import train_metrics


def run(tmp: Path, name: str, hardware: str, args) -> dict:
    from finetune.tiny import prompt_records, write_jsonl

    data = write_jsonl(prompt_records(512, seed=1), tmp / "prompts.jsonl")
    config = tmp / f"{name}.yaml"
    config.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp / "cache"}}}
method: {{name: grpo, num_generations: {args.generations}, max_new_tokens: {args.max_new_tokens},
  rewards: [{{function: exact_match, args: {{column: answer}}}}]}}
adapter: {{type: lora, r: 16, alpha: 32}}
train: {{global_batch_size: 64, micro_batch_size: 32, max_steps: {args.steps}, lr: 1.0e-4}}
output: {{dir: {tmp / name}, log_steps: 1, save_steps: 0}}
""")
    rows = train_metrics(config, hardware, tmp / name)
    rows = [x for x in rows if "rollout_s" in x and x["step"] > 2]
    times = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    ranks = 2 if hardware.endswith(":2") else 1
    return {
        "step_s": statistics.median(times),
        "rollout_s": statistics.median(x["rollout_s"] for x in rows),
        "gen_tps": statistics.median(ranks * x["generated_tokens"] / x["rollout_s"] for x in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {"1 process": run(tmp, "one", "cpu", args), "2 processes, DDP": run(tmp, "two", "cpu:2", args)}
    base = results["1 process"]
    print(
        f"ft-tiny + LoRA r16, GRPO: 64 completions per step ({64 // args.generations} prompts x {args.generations}), "
        f"up to {args.max_new_tokens} new tokens, {args.steps} steps, CPU/gloo"
    )
    for name, r in results.items():
        print(
            f"  {name:<18} {1 / r['step_s']:6.2f} steps/s ({base['step_s'] / r['step_s']:4.2f}x)   rollout "
            f"{r['rollout_s'] / r['step_s']:4.0%} of a step   "
            f"{r['gen_tps']:8,.0f} generated tokens/s ({r['gen_tps'] / base['gen_tps']:4.2f}x)"
        )


if __name__ == "__main__":
    main()
