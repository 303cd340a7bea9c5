"""Canonical records -> token ids with loss labels, one function per format, plus length handling.

Output columns:
  SFT formats (chat, instruction, completion, prompt_completion): input_ids, labels, length
  preference: chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels, length (the longer)
  prompt_only: prompt_ids, prompt (JSON of the messages), extra, length
Labels are IGNORE (-100) on tokens that carry no loss. `_origin` is kept for error messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from finetune.data.masking import IGNORE, tokenize_continuation, tokenize_conversation, tokenize_prompt

SFT_FORMATS = ("chat", "instruction", "completion", "prompt_completion")


@dataclass(frozen=True)
class Rules:
    """What the tokenizer step needs from the config, nothing more."""

    format: str
    train_on: str  # assistant | last_assistant | all
    seq_len: int
    overlong: str  # truncate | drop
    max_prompt_len: int  # prompt_only: room left for the completion


def tokenize_record(rec: dict, rules: Rules, tokenizer, jinja: str | None) -> dict:
    """One canonical record -> token columns (before length handling)."""
    fmt = rules.format
    if fmt in ("chat", "instruction"):
        ids, labels = tokenize_conversation(rec["messages"], tokenizer, jinja, rules.train_on)
        return {"input_ids": ids, "labels": labels}
    if fmt == "completion":
        ids = _encode(tokenizer, rec["text"]) + [tokenizer.eos_token_id]
        return {"input_ids": ids, "labels": list(ids)}
    if fmt == "prompt_completion":
        prompt = _encode(tokenizer, rec["prompt"])
        completion = _encode(tokenizer, rec["completion"]) + [tokenizer.eos_token_id]
        prompt_labels = list(prompt) if rules.train_on == "all" else [IGNORE] * len(prompt)
        return {"input_ids": prompt + completion, "labels": prompt_labels + completion}
    if fmt == "preference":
        c_ids, c_labels = tokenize_continuation(rec["prompt"], rec["chosen"], tokenizer, jinja)
        r_ids, r_labels = tokenize_continuation(rec["prompt"], rec["rejected"], tokenizer, jinja)
        return {"chosen_input_ids": c_ids, "chosen_labels": c_labels, "rejected_input_ids": r_ids, "rejected_labels": r_labels}
    if fmt == "prompt_only":
        return {"prompt_ids": tokenize_prompt(rec["prompt"], tokenizer, jinja), "prompt": json.dumps(rec["prompt"]), "extra": rec.get("extra", "{}")}
    raise ValueError(f"unknown format {fmt!r}")


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([bos] if bos is not None else []) + ids


def fit_length(row: dict, rules: Rules) -> tuple[dict | None, str]:
    """Apply seq_len: returns (row or None, what happened: kept | truncated | dropped_long | dropped_untrained)."""
    if rules.format == "prompt_only":
        n = len(row["prompt_ids"])
        if n <= rules.max_prompt_len:
            return {**row, "length": n}, "kept"
        if rules.overlong == "drop":
            return None, "dropped_long"
        return {**row, "prompt_ids": row["prompt_ids"][-rules.max_prompt_len:], "length": rules.max_prompt_len}, "truncated"
    keys = ("chosen_", "rejected_") if rules.format == "preference" else ("",)
    status = "kept"
    out = dict(row)
    for k in keys:
        ids, labels = out[f"{k}input_ids"], out[f"{k}labels"]
        if len(ids) > rules.seq_len:
            if rules.overlong == "drop":
                return None, "dropped_long"
            out[f"{k}input_ids"], out[f"{k}labels"] = ids[: rules.seq_len], labels[: rules.seq_len]
            status = "truncated"
        if all(t == IGNORE for t in out[f"{k}labels"][1:]):
            return None, "dropped_untrained"
    out["length"] = max(len(out[f"{k}input_ids"]) for k in keys)
    return out, status
