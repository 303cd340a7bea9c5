"""Builders shared by the rollout tests (GRPO's planner, vLLM's engines and server, Ray): the planner's GRPO job
texts, the trainer's log-probs against an engine's, one training step through ft's engine, a run's metrics, and the
sevens task (a reward with room to double). No test file imports another; they import these."""

from __future__ import annotations

import json

import torch

from finetune.catalog import lookup
from finetune.config import loads
from finetune.hardware import parse
from finetune.plan import plan
from finetune.plan.plan import Plan
from tests.helpers import MINIMAL

SEQUENCES = [[3, 17, 42, 8, 99, 5, 61, 7, 250, 31], [12, 6, 200, 19, 4, 77, 90]]

GRPO = (
    MINIMAL.replace(
        "method: {name: sft}", "method: {name: grpo, rewards: [{function: exact_match}], max_new_tokens: 512}"
    )
    .replace("format: chat", "format: prompt_only")
    .replace("  packing: true\n", "")
)
FULL = GRPO.replace("adapter: {type: lora, r: 16, alpha: 32, target_modules: all-linear}", "adapter: {type: full}")
LLAMA8B = "meta-llama/Llama-3.1-8B"


def make(hardware, model=LLAMA8B, overrides=(), text=GRPO) -> Plan:
    cfg = loads(text, overrides=[f"model.name={model}", *overrides], environ={})
    return plan(cfg, parse(hardware), lookup(model))


def trainer_logps(model, sequences) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for seq in sequences:
            logps = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
            out.append([logps[i - 1, t].item() for i, t in enumerate(seq) if i > 0])
    return out


def largest_gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def one_training_step(model):
    """ft's engine around `model`, after one AdamW step on a next-token loss (every trained parameter moves)."""
    from finetune.distributed.engine import TorchEngine

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=2e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    engine = TorchEngine(model, optimizer, scheduler, 1.0, False, torch.device("cpu"))
    ids = torch.tensor(SEQUENCES[:1])
    model(input_ids=ids, labels=ids).loss.backward()
    engine.step()
    return engine


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


SEVENS = """
def sevens(completions, **_):
    return [float(c.count("7")) for c in completions]
"""


def sevens_job(tmp_path, model, steps: int) -> str:
    """GRPO that rewards each '7' a completion writes (the SFT model writes few: a reward with room to double)."""
    from finetune.tiny import prompt_records, write_jsonl

    prompts = write_jsonl(prompt_records(8, seed=5), tmp_path / "prompts.jsonl")
    (tmp_path / "sevens.py").write_text(SEVENS)
    path = tmp_path / "sevens.yaml"
    path.write_text(f"""
model: {{name: {model}}}
data: {{datasets: [{{path: {prompts}, format: prompt_only}}], seq_len: 64, cache_dir: {tmp_path / "cache"}}}
method: {{name: grpo, engine: vllm, num_generations: 8, max_new_tokens: 8, rollout: {{placement: server}},
  rewards: [{{function: {tmp_path}/sevens.py:sevens}}]}}
adapter: {{type: full}}
train: {{global_batch_size: 64, micro_batch_size: 32, max_steps: {steps}, lr: 1.0e-4, scheduler: constant}}
output: {{dir: {tmp_path / "run"}, log_steps: 1, save_steps: 10}}
""")
    return str(path)
