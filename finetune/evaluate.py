"""Evaluation during training: validation loss, and a task metric by greedy generation."""

from __future__ import annotations

import json
from pathlib import Path

import torch


@torch.no_grad()
def validation_loss(model, method, dataset, device, autocast, batch_rows: int = 32) -> float:
    """Mean next-token loss over every trained token of the validation set."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    for start in range(0, len(dataset), batch_rows):
        for batch in method.micro_batches(dataset, list(range(start, min(start + batch_rows, len(dataset))))):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            n = method.tokens(batch)
            with autocast():
                loss, _ = method.loss(model, batch, 1.0)
            total, tokens = total + float(loss), tokens + n
    model.train(was_training)
    return total / max(tokens, 1)


def read_tasks(path: str | Path, samples: int | None) -> list[tuple[list[dict], str]]:
    """(prompt messages, reference answer) pairs from a chat-format jsonl file."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            messages = json.loads(line)["messages"]
            out.append((messages[:-1], messages[-1]["content"]))
    return out[:samples] if samples else out


@torch.no_grad()
def task_accuracy(model, tokenizer, tasks, metric: str, max_new_tokens: int, device, batch_size: int = 32) -> float:
    """Fraction of prompts whose greedy answer matches the reference (exact_match or contains)."""
    was_training = model.training
    model.eval()
    hits = 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in chunk]
        enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        width = max(len(e) for e in enc)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=device)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=_stop_ids(tokenizer))
        for row, (_, reference) in zip(out[:, width:], chunk):
            answer = tokenizer.decode(row, skip_special_tokens=True).strip()
            hits += answer == reference.strip() if metric == "exact_match" else reference.strip() in answer
    model.train(was_training)
    return hits / max(len(tasks), 1)


def _stop_ids(tokenizer) -> list[int]:
    """EOS plus the end-of-turn tokens of common chat templates that the tokenizer knows."""
    vocab = tokenizer.get_vocab()
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return ids + [vocab[t] for t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>") if t in vocab and vocab[t] not in ids]

