"""Training throughput of ft's loop against a minimal hand-written torch + peft loop, in one run.

Same model (a small Llama built here), same tokenized data, micro-batch, seq_len, steps and LoRA
settings; one thread; CPU time per real (non-padding) token, so the figures are ratios, not absolute
speeds. Also prints model FLOP utilisation against this machine's measured fp32 matmul peak.

    python bench/train_bench.py [--steps 40] [--micro 8] [--seq-len 512] [--compile]

--compile adds a row with train.compile: true (each decoder layer compiled by torch.compile; on a CPU this needs a
C++ compiler); its compile time is spent in warm-up steps, outside the measured CPU time.
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
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
from common import build_llama  # noqa: E402

torch.set_num_threads(1)


def chat_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = (
        "the model learns to add numbers and answer questions about text data while training on small examples".split()
    )
    out = []
    for _ in range(n):
        user = " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(2, 120)))
        out.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return out


def build_model(folder: Path):
    return build_llama(folder, max_positions=1024)


def job(tmp: Path, data: Path, packing: bool, micro: int, seq_len: int, steps: int, batch: int) -> str:
    return f"""
model: {{name: {tmp / "model"}}}
data: {{datasets: [{{path: {data}, format: chat}}], seq_len: {seq_len}, packing: {str(packing).lower()},
  cache_dir: {tmp / "cache"}}}
adapter: {{type: lora, r: 16, alpha: 32, dropout: 0.0}}
train: {{global_batch_size: {batch}, micro_batch_size: {micro}, max_steps: {steps}, lr: 1.0e-4,
  gradient_checkpointing: false, precision: fp32}}
output: {{dir: {tmp / "run"}}}
"""


def ft_stepper(text: str):
    """One optimizer step of ft's loop per call (setup excluded); returns the real tokens it trained on."""
    from finetune.config import loads
    from finetune.data.preprocess import prepare
    from finetune.hardware import parse
    from finetune.plan import plan
    from finetune.train import setup, train_step
    from finetune.workflow import model_facts

    config = loads(text)
    p = plan(config, parse("cpu"), model_facts(config.model))
    j = setup(config, p, prepare(config))
    return lambda: train_step(j)["tokens"]


def hand_stepper(text: str, micro: int, batch: int):
    """The minimal loop a practitioner writes: pad each micro-batch to its longest row, HF loss, AdamW."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.config import loads
    from finetune.data.preprocess import prepare

    config = loads(text)
    rows = prepare(config).train
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(config.model.name, attn_implementation="sdpa")
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    ids_col, lab_col = rows["input_ids"][:], rows["labels"][:]
    pad, state = 1, {"k": 0}

    def step() -> int:
        tokens, k = 0, state["k"]
        state["k"] += 1
        idx = [order[(k * batch + i) % len(order)] for i in range(batch)]
        for m in range(0, batch, micro):
            chunk = idx[m : m + micro]
            width = max(len(ids_col[i]) for i in chunk)
            ids = torch.tensor([ids_col[i] + [pad] * (width - len(ids_col[i])) for i in chunk])
            labels = torch.tensor([lab_col[i] + [-100] * (width - len(lab_col[i])) for i in chunk])
            mask = torch.tensor([[1] * len(ids_col[i]) + [0] * (width - len(ids_col[i])) for i in chunk])
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / (batch // micro)
            loss.backward()
            tokens += int(mask.sum())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return tokens

    return step


def compiled_steppers(plain: str, packed: str, warmup: int = 3) -> dict:
    """ft with train.compile: true, without and with packing; `warmup` steps first, which compile the layers (once
    for the first lengths, once more when torch switches to lengths it treats as dynamic)."""
    out = {}
    for name, text in (("ft (no packing, compiled)", plain), ("ft (packing, compiled)", packed)):
        step = ft_stepper(text.replace("precision: fp32}", "precision: fp32, compile: true}"))
        start = time.perf_counter()
        for _ in range(warmup):
            step()
        print(f"{name}: {warmup} warm-up steps (compiling) took {time.perf_counter() - start:.0f} s")
        out[name] = step
    return out


def interleaved(steppers: dict, steps: int) -> dict[str, tuple[float, int]]:
    """CPU seconds and tokens per stepper, running one step of each in turn so machine noise hits all alike."""
    totals = {name: [0.0, 0] for name in steppers}
    for step in steppers.values():
        step()  # warm-up
    for _ in range(steps):
        for name, step in steppers.items():
            start = time.process_time()
            tokens = step()
            totals[name][0] += time.process_time() - start
            totals[name][1] += tokens
    return {name: (cpu, tokens) for name, (cpu, tokens) in totals.items()}


def matmul_peak_gflops(n: int = 1024, reps: int = 10, trials: int = 5) -> float:
    """Best of several timed runs of an n x n fp32 matmul on one thread (CPU time)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(trials):
        start = time.process_time()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.process_time() - start) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="also run ft with train.compile: true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        params = build_model(tmp / "model")
        data = tmp / "chat.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in chat_records(2000)))
        plain, packed = (job(tmp, data, p, args.micro, args.seq_len, args.steps, args.batch) for p in (False, True))
        masked = packed.replace(f"name: {tmp / 'model'}}}", f"name: {tmp / 'model'}, attn_implementation: sdpa}}")
        steppers = {
            "hand loop (no packing)": hand_stepper(plain, args.micro, args.batch),
            "ft (no packing)": ft_stepper(plain),
            "ft (packing)": ft_stepper(packed),
            "ft (packing, 4-D mask)": ft_stepper(masked),
        }
        if args.compile:
            steppers.update(compiled_steppers(plain, packed))
        results = interleaved(steppers, args.steps)
        peak = matmul_peak_gflops()
        print(
            f"model: {params:,} parameters, LoRA r=16 on all linear layers, fp32, 1 thread; {args.steps} steps "
            f"of {args.batch} rows (micro-batch {args.micro}), seq_len {args.seq_len}"
        )
        base = results["hand loop (no packing)"][1] / results["hand loop (no packing)"][0]
        for name, (cpu, tokens) in results.items():
            tps = tokens / cpu
            mfu = 4 * params * tps / (peak * 1e9)
            print(
                f"{name:<24} {tps:9,.0f} real tokens per CPU-second   {tps / base:5.2f}x hand loop   MFU "
                f"{100 * mfu:4.1f}%"
            )
        print(
            "MFU: 4N FLOPs per token (forward 2N + input gradients 2N; frozen weights need no weight gradients; "
            "LoRA and attention FLOPs not counted)"
        )
        print(f"     against the fp32 matmul peak measured here: {peak:,.1f} GFLOP/s (1 thread, 1024x1024, best of 5)")


if __name__ == "__main__":
    main()
