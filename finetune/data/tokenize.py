"""Canonical records -> token ids with loss labels, one function per format, plus length handling.

Output columns:
  SFT formats (chat, instruction, completion, prompt_completion): input_ids, labels, length
  preference: chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels, margin (None when the record has
    none), length (the longer)
  prompt_only: prompt_ids, prompt (JSON of the messages), extra, length
  unpaired: input_ids, labels (the completion's), desirable (the record's label), length
Labels are IGNORE (-100) on tokens that carry no loss. `_origin` is kept for error messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from finetune.data.masking import IGNORE, tokenize_continuation, tokenize_conversation, tokenize_prompt
from finetune.errors import DataError

SFT_FORMATS = ("chat", "instruction", "completion", "prompt_completion")
CHARS_PER_TOKEN = 8  # the first cut: characters of text per token of seq_len (widened when too short)
MARGIN = 16  # tokens past seq_len that a cut record must keep, so that the cut cannot change what is kept
MANY_MESSAGES = 16  # longer conversations are cut to the messages that start within seq_len (masking is quadratic)
_UNTRAINED = "_untrained"


def pad_id(tokenizer, fallback: int | None = None) -> int:
    """The id batches are padded with: the tokenizer's pad token, else `fallback`, else its end-of-sequence token
    (padding never carries loss or attention, so any id works; EOS is what most base models would have used)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return fallback if fallback is not None else tokenizer.eos_token_id


@dataclass(frozen=True)
class Rules:
    """What the tokenizer step needs from the config, nothing more."""

    format: str
    train_on: str  # assistant | last_assistant | all
    seq_len: int
    overlong: str  # truncate | drop
    max_prompt_len: int  # prompt_only: room left for the completion


def tokenize_record(rec: dict, rules: Rules, tokenizer, jinja: str | None, processor=None) -> dict:
    """One canonical record -> token columns (before length handling).

    Time is bounded by seq_len, not by the record: a record with far more text than seq_len tokens can
    hold, or a conversation of many messages, is first tokenized cut short (its text cut, the messages
    that start after the first seq_len tokens left out). When the cut
    record still has more than seq_len + MARGIN tokens, the cut is past what truncation keeps, and the
    cut record gives the same first seq_len tokens and labels, and the same kept/truncated/dropped
    status, as the whole one; otherwise the cut is widened (x4) until the whole record is used.
    prompt_only and preference records are never cut (prompts are truncated from the left).
    """
    if processor is not None and rules.format in ("chat", "preference", "unpaired"):  # a vision-language model's rows
        return _with_images(rec, rules, processor, jinja)
    if rec.get("images"):
        raise DataError(
            "this record has images, which this job cannot use: ft trains on images with methods sft (chat records), "
            "dpo, orpo, simpo (preference pairs) and kto (judged rows) on a vision-language model whose folder holds "
            "its processor files; use such a model and method, or leave the images out"
        )
    budget = CHARS_PER_TOKEN * (rules.seq_len + MARGIN)
    for _ in range(16):  # 4**16 times the first budget is past any record a line can hold
        short = _shortened(rec, rules, budget, tokenizer, jinja)
        if short is None:
            break
        row = tokenize_whole(short, rules, tokenizer, jinja)
        if _length(row) > rules.seq_len + MARGIN:
            return row
        budget *= 4
    return tokenize_whole(rec, rules, tokenizer, jinja)


def _with_images(rec: dict, rules: Rules, processor, jinja: str | None) -> dict:
    """A chat record for a vision-language model: each image marker expanded into the image's tokens by the model's
    processor (finetune/vision.py), never trained; the rows keep the images' files. Never cut short: a cut could
    fall inside an image's tokens (fit_length refuses image rows over seq_len instead)."""
    from finetune import vision

    images = list(rec.get("images") or [])

    def continuation(answer: list[dict]) -> tuple[list[int], list[int]]:
        if images:
            return vision.tokenize_pair_side(rec["prompt"], answer, images, processor, jinja)
        return tokenize_continuation(rec["prompt"], answer, processor.tokenizer, jinja)

    if rules.format == "unpaired":
        ids, labels = continuation(rec["completion"])
        return {"input_ids": ids, "labels": labels, "desirable": bool(rec["label"]), "images": images}
    if rules.format == "preference":
        row = {"images": images, "margin": rec.get("margin")}
        for side in ("chosen", "rejected"):
            row[f"{side}_input_ids"], row[f"{side}_labels"] = continuation(rec[side])
        return row
    if images:
        ids, labels = vision.tokenize_images(rec["messages"], images, processor, jinja, rules.train_on)
    else:
        ids, labels = tokenize_conversation(rec["messages"], processor.tokenizer, jinja, rules.train_on)
    return {"input_ids": ids, "labels": labels, "images": images}


def _length(row: dict) -> int:
    return max(len(row[k]) for k in ("input_ids", "chosen_input_ids", "prompt_ids") if k in row)


def _shortened(rec: dict, rules: Rules, budget: int, tokenizer, jinja: str | None) -> dict | None:
    """The record with its text cut after `budget` characters; None when it is not longer than that."""
    fmt = rules.format
    if fmt == "completion" and isinstance(rec.get("text"), str):
        return {**rec, "text": rec["text"][:budget]} if len(rec["text"]) > budget else None
    if fmt == "prompt_completion" and all(isinstance(rec.get(k), str) for k in ("prompt", "completion")):
        if len(rec["prompt"]) + len(rec["completion"]) <= budget:
            return None
        prompt = rec["prompt"][:budget]
        return {**rec, "prompt": prompt, "completion": rec["completion"][: budget - len(prompt)]}
    if fmt in ("chat", "instruction"):
        return _shortened_messages(rec, rules, budget, tokenizer, jinja)
    return None


def _shortened_messages(rec: dict, rules: Rules, budget: int, tokenizer, jinja: str | None) -> dict | None:
    """Messages up to `budget` characters of content (the last one cut), then only those that start
    within the first seq_len + MARGIN tokens; None when nothing is left out."""
    messages = rec.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        return None
    total = sum(len(m["content"]) for m in messages)
    if total <= budget and len(messages) <= MANY_MESSAGES:
        return None
    kept, used = [], 0
    for m in messages:
        if used >= budget:
            break
        kept.append({**m, "content": m["content"][: budget - used]})
        used += len(m["content"])
    kept = kept[: _starting_within(kept, rules.seq_len + MARGIN, tokenizer, jinja)]
    if total <= budget and len(kept) == len(messages):
        return None
    out = {**rec, "messages": kept}
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if rules.train_on == "last_assistant" and assistants and assistants[-1] >= len(kept):
        out[_UNTRAINED] = True  # the one trained turn starts after the cut: nothing within seq_len is trained
    return out


def _starting_within(messages: list[dict], tokens: int, tokenizer, jinja: str | None) -> int:
    """How many leading messages can start within the first `tokens` tokens of the rendered conversation.

    Rendering a conversation once and tokenizing it are linear; masking renders every prefix that ends
    in a trained turn, which is quadratic in the number of messages: so they are cut here first. A
    message starts after the previous message's content ends (contents are rendered in order)."""
    from finetune.templates import render

    if jinja is None or not getattr(tokenizer, "is_fast", False):
        return len(messages)
    text = render(messages, tokenizer, jinja)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if len(offsets) <= tokens:
        return len(messages)
    limit, pos = offsets[tokens][0], 0
    for k, m in enumerate(messages):
        found = text.find(m["content"], pos)
        if found < 0:
            return len(messages)  # the template changes the content: keep everything
        pos = found + len(m["content"])
        if pos > limit:
            return k + 1
    return len(messages)


def tokenize_whole(rec: dict, rules: Rules, tokenizer, jinja: str | None) -> dict:
    """The record tokenized as it is, never cut short: what tokenize_record's result must equal after length
    handling (the reference its shortcut is tested against)."""
    fmt = rules.format
    if fmt in ("chat", "instruction"):
        if rec.get(_UNTRAINED):  # shortened past the last assistant turn
            ids, _ = tokenize_conversation(rec["messages"], tokenizer, jinja, "all")
            return {"input_ids": ids, "labels": [IGNORE] * len(ids)}
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
        row = {}
        for side in ("chosen", "rejected"):
            row[f"{side}_input_ids"], row[f"{side}_labels"] = tokenize_continuation(
                rec["prompt"], rec[side], tokenizer, jinja
            )
        return {**row, "margin": rec.get("margin")}
    if fmt == "unpaired":
        ids, labels = tokenize_continuation(rec["prompt"], rec["completion"], tokenizer, jinja)
        return {"input_ids": ids, "labels": labels, "desirable": bool(rec["label"])}
    if fmt == "prompt_only":
        return {
            "prompt_ids": tokenize_prompt(rec["prompt"], tokenizer, jinja),
            "prompt": json.dumps(rec["prompt"]),
            "extra": rec.get("extra", "{}"),
        }
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
        return {
            **row,
            "prompt_ids": row["prompt_ids"][-rules.max_prompt_len :],
            "length": rules.max_prompt_len,
        }, "truncated"
    keys = ("chosen_", "rejected_") if rules.format == "preference" else ("",)
    status = "kept"
    out = dict(row)
    for k in keys:
        ids, labels = out[f"{k}input_ids"], out[f"{k}labels"]
        if len(ids) > rules.seq_len and row.get("images"):
            image_tokens = sum(1 for a, b in zip(ids, labels) if b == IGNORE)
            raise DataError(
                f"with its {len(row['images'])} image(s) this record is {len(ids)} tokens (at most {image_tokens} of "
                f"them the images' and the template's), over data.seq_len {rules.seq_len}; an image row is never "
                "cut (its image tokens must all reach the model): raise data.seq_len, or lower the images' "
                "resolution (the processor's max_pixels)"
            )
        if len(ids) > rules.seq_len:
            if rules.overlong == "drop":
                return None, "dropped_long"
            out[f"{k}input_ids"], out[f"{k}labels"] = ids[: rules.seq_len], labels[: rules.seq_len]
            status = "truncated"
        if all(t == IGNORE for t in out[f"{k}labels"][1:]):
            return None, "dropped_untrained"
    out["length"] = max(len(out[f"{k}input_ids"]) for k in keys)
    return out, status
