"""Tokens/s of the tiny model on 1 process and on 2 processes (DDP, FSDP, DeepSpeed ZeRO-1/2/3), CPU/gloo, plus the
planner's
communication estimate for realistic multi-GPU jobs.

    python bench/distributed_bench.py [--steps 30]

Each run is a real `ft train` (2 processes are started by ft through torchrun, OMP_NUM_THREADS=1);
throughput is the median over steps of real tokens per second, summed over ranks. On a 2-core machine
two processes share the cores that one process had, so compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import REPO, train_metrics


def run(tmp: Path, name: str, hardware: str, backend: str, steps: int, sharding: str = "auto") -> float:
    from finetune.tiny import arithmetic_records, write_jsonl

    data = write_jsonl(arithmetic_records(2000, seed=1), tmp / "data.jsonl")
    config = tmp / f"{name}.yaml"
    config.write_text(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: 64, cache_dir: {tmp / "cache"}}}
adapter: {{type: full}}
train: {{global_batch_size: 64, micro_batch_size: 32, max_steps: {steps}, lr: 1.0e-3}}
distributed: {{backend: {backend}, sharding: {sharding}}}
output: {{dir: {tmp / name}, log_steps: 1, save_steps: 0}}
""")
    rows = train_metrics(config, hardware, tmp / name)
    return statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 2)


def communication() -> None:
    from finetune.workflow import compile_plan

    jobs = [
        ("examples/yaml/llama3.1-8b-full-8xh100.yaml", "8xH100-80GB"),
        ("examples/yaml/llama3.1-8b-full-8xh100.yaml", "2x8xH100-80GB"),
        ("examples/yaml/llama3.3-70b-qlora-2gpu.yaml", "2xA6000-48GB"),
        ("examples/yaml/llama3.1-8b-lora-24gb.yaml", "8xA10G-24GB"),
    ]
    print("\nplanner's communication estimate (per rank and optimizer step):")
    for path, hardware in jobs:
        p = compile_plan(REPO / path, hardware=hardware)
        traffic = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in p.communication.items())
        print(
            f"  {Path(path).stem} on {hardware}: {p.backend}/{p.sharding or '-'}, {traffic}, about "
            f"{p.communication_seconds:.2f} s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {
            "1 process": run(tmp, "one", "cpu", "auto", args.steps),
            "2 processes, DDP": run(tmp, "ddp", "cpu:2", "ddp", args.steps),
            "2 processes, FSDP": run(tmp, "fsdp", "cpu:2", "fsdp", args.steps),
        }
        try:
            import deepspeed  # noqa: F401

            for stage in ("zero1", "zero2", "zero3"):
                results[f"2 processes, {stage}"] = run(tmp, stage, "cpu:2", "deepspeed", args.steps, stage)
        except ImportError:
            print("deepspeed is not installed: DeepSpeed runs skipped")
    base = results["1 process"]
    print(f"ft-tiny, full fine-tuning, global batch 64, micro-batch 32, seq_len 64, {args.steps} steps, CPU/gloo")
    for name, tps in results.items():
        print(f"  {name:<22} {tps:9,.0f} tokens/s   {tps / base:4.2f}x")
    communication()


if __name__ == "__main__":
    main()
