"""GRPO with transformers rollouts against vLLM rollouts (colocated, and a separate rollout server process), side by
side in one run: optimizer steps/s and generated tokens/s on CPU.

    OMP_NUM_THREADS=1 python bench/grpo_rollout_bench.py [--steps 12] [--max-new-tokens 32] [--rounds 1] \
        [--hidden 256] [--layers 4] [--columns "transformers,vllm colocated"]

Run it in an environment with vLLM (scripts/setup-vllm.sh makes .venv-vllm). Every column is a real `ft train` of the
same GRPO job: a Llama built here (--hidden 256, --layers 4 by default, ft-tiny's tokenizer), 64 completions per step
(8 prompts × 8), full fine-tuning, one process. From metrics.jsonl: seconds per step (median over the steps after the
first two), and generated tokens per second of rollout (generated_tokens / rollout_s). The server column runs vLLM in
a second process started by ft train: on a 2-core machine it shares the cores with the trainer, so compare ratios
within one run, not absolute figures across machines. The asynchronous columns generate the next rollout while the
current one trains (one batch off-policy).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import build_llama, train_metrics

COLUMNS = {
    "transformers": "engine: transformers",
    "vllm colocated": "engine: vllm",
    "vllm colocated async": "engine: vllm, rollout: {asynchronous: true}",
    "vllm server": "engine: vllm, rollout: {placement: server}",
    "vllm server async": "engine: vllm, rollout: {placement: server, asynchronous: true}",
}


def run(tmp: Path, model: Path, name: str, method: str, args, round_: int) -> dict:
    from finetune.tiny import prompt_records, write_jsonl

    data = write_jsonl(prompt_records(512, seed=1), tmp / "prompts.jsonl")
    run_dir = tmp / f"{name.replace(' ', '-')}-{round_}"
    config = tmp / f"{run_dir.name}.yaml"
    config.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {data}, format: prompt_only}}], seq_len: 96, cache_dir: {tmp / "cache"}}}
method: {{name: grpo, num_generations: 8, max_new_tokens: {args.max_new_tokens}, {method},
  rewards: [{{function: exact_match, args: {{column: answer}}}}]}}
adapter: {{type: full}}
train: {{global_batch_size: 64, micro_batch_size: 32, max_steps: {args.steps}, lr: 1.0e-5}}
output: {{dir: {run_dir}, log_steps: 1, save_steps: 0}}
""")
    rows = train_metrics(config, "cpu", run_dir)
    steps = [x for x in rows if "rollout_s" in x]
    times = [b["time"] - a["time"] for a, b in zip(steps[1:], steps[2:])]
    return {
        "step_s": statistics.median(times),
        "gen_tok_s": sum(x["generated_tokens"] for x in steps) / max(sum(x["rollout_s"] for x in steps), 1e-9),
        "rollout_share": statistics.median(x["rollout_s"] for x in steps[2:]) / statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma-separated, from: " + ", ".join(COLUMNS))
    args = parser.parse_args()
    names = [c.strip() for c in args.columns.split(",")]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        params = build_llama(tmp / "model", hidden=args.hidden, layers=args.layers)
        print(
            f"model: {params / 1e6:.1f}M parameters; {args.steps} steps of 64 completions, {args.max_new_tokens} "
            "new tokens at most"
        )
        results = {name: [] for name in names}
        for round_ in range(args.rounds):  # interleaved: each round runs every column once
            for name in names:
                results[name].append(run(tmp, tmp / "model", name, COLUMNS[name], args, round_))
        base = statistics.median(r["step_s"] for r in results[names[0]])
        print(f"{'rollouts':<24}{'s/step':>9}{'steps/s':>9}{'× ' + names[0]:>18}{'gen tok/s':>11}{'rollout share':>15}")
        for name in names:
            step = statistics.median(r["step_s"] for r in results[name])
            tok = statistics.median(r["gen_tok_s"] for r in results[name])
            share = statistics.median(r["rollout_share"] for r in results[name])
            print(f"{name:<24}{step:>9.3f}{1 / step:>9.2f}{base / step:>18.2f}{tok:>11.0f}{share:>15.0%}")


if __name__ == "__main__":
    main()
