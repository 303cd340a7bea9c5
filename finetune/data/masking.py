"""Token ids and loss labels for conversations, for any chat template.

How the trained tokens are found (the same way for every template, built-in or not):
1. Render the whole conversation once.
2. For each trained assistant message i, render the messages before it with the generation prompt
   (`head`) and the messages up to and including it (`turn`). Both must be prefixes of the whole
   rendering; the turn's text is `whole[len(head):len(turn)]`: the reply, the template's end-of-turn
   text (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>`, `<|end|>`, eos, ...) and whatever
   separator follows it.
3. Tokenize the whole text once (fast tokenizer, offsets, no added special tokens: the template writes
   BOS itself) and label every token whose characters overlap a trained span.

What is trained (the documented rule): the turn's text up to and including its end-of-turn token,
but NOT the whitespace the template writes after it (the newline after `<|im_end|>` or
`<end_of_turn>`): generation stops at the end-of-turn token, so the model never emits that newline.
Text a template puts between the generation prompt and the content (mistral's space after [/INST])
is trained, since the model writes it. A token that straddles a span edge is trained.

Checks that turn silent masking bugs into TemplateErrors: a template that renders earlier turns
differently once later ones exist (Qwen3-style reasoning removal, "last message" branches); a
generation prompt that is not the start of the assistant turn; an assistant turn that does not
contain its content; a turn with nothing after the content (no end-of-turn token to learn); a template
with no generation prompt whose assistant header would be trained; a rendering starting with two BOS.

Labels are aligned with input_ids (not shifted); the loss shifts them. IGNORE marks untrained tokens.
"""

from __future__ import annotations

from finetune.data.readers import short
from finetune.errors import DataError
from finetune.templates import TemplateError, describe, render

IGNORE = -100  # the label of a position that is not trained (torch cross_entropy's ignore_index); the one definition
TRAIN_ON = ("assistant", "last_assistant", "all")


def tokenize_conversation(messages, tokenizer, jinja: str, train_on: str = "assistant") -> tuple[list[int], list[int]]:
    """input_ids and labels of a conversation; labels are IGNORE where not trained.

    train_on: "assistant" (every assistant turn with its end-of-turn token), "last_assistant" (only the
    final assistant turn), "all" (every token). With no assistant message, "assistant" labels nothing:
    the caller decides whether to drop such a sample.
    """
    _check_messages(messages)
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, not {train_on!r}")
    if train_on == "all":
        ids, _ = _encode(render(messages, tokenizer, jinja), tokenizer, jinja)
        return ids, list(ids)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "last_assistant":
        trained = trained[-1:]
    return _tokenize_with_spans(messages, tokenizer, jinja, trained)


def tokenize_prompt(messages, tokenizer, jinja: str) -> list[int]:
    """Token ids of a prompt rendered with the generation prompt, ready for the model's reply."""
    _check_messages(messages)
    ids, _ = _encode(render(messages, tokenizer, jinja, add_generation_prompt=True), tokenizer, jinja)
    return ids


def tokenize_continuation(prompt_messages, continuation_messages, tokenizer, jinja: str) -> tuple[list[int], list[int]]:
    """input_ids and labels of prompt + continuation as one conversation; only the continuation's
    assistant turns (with their end-of-turn tokens) are labelled. For preference pairs."""
    messages = list(prompt_messages) + list(continuation_messages)
    _check_messages(messages)
    start = len(prompt_messages)
    trained = [i for i in range(start, len(messages)) if messages[i]["role"] == "assistant"]
    if not trained:
        raise DataError(
            "a preference continuation (chosen/rejected) has no assistant message to train on; "
            f"its roles are {[m['role'] for m in continuation_messages]}"
        )
    return _tokenize_with_spans(messages, tokenizer, jinja, trained)


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"a conversation must be a non-empty list of messages, got {short(messages)}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"message {i} must be a dict with a string `role` (and `content`), got {short(message)}")


def _tokenize_with_spans(messages, tokenizer, jinja, trained: list[int]) -> tuple[list[int], list[int]]:
    text = render(messages, tokenizer, jinja)
    spans = [_assistant_span(messages, i, text, tokenizer, jinja) for i in trained]
    ids, offsets = _encode(text, tokenizer, jinja)
    return ids, _labels(ids, offsets, spans)


def _assistant_span(messages, i: int, whole: str, tokenizer, jinja) -> tuple[int, int]:
    """Character span [start, end) of assistant message i's trained text within `whole`."""
    if i == 0:
        raise DataError("message 0 is an assistant message; a conversation must start with a system or user message")
    name = describe(jinja, tokenizer)
    head = render(messages[:i], tokenizer, jinja, add_generation_prompt=True)
    turn = whole if i == len(messages) - 1 else render(messages[: i + 1], tokenizer, jinja)
    _check_prefix(head, whole, name, f"messages[:{i}] with the generation prompt")
    _check_prefix(turn, whole, name, f"messages[:{i + 1}]")
    if len(head) > len(turn):
        raise TemplateError(
            f"{name}: the generation prompt {whole[len(turn) : len(head)]!r} is not how it starts assistant "
            f"message {i}.\n    fix: make add_generation_prompt write exactly the assistant turn's header"
        )
    span = whole[len(head) : len(turn)].rstrip()
    _check_turn(messages, i, span, head, tokenizer, jinja, name)
    return len(head), len(head) + len(span)


def _check_prefix(part: str, whole: str, name: str, what: str) -> None:
    if whole.startswith(part):
        return
    at = next((k for k, (a, b) in enumerate(zip(part, whole)) if a != b), min(len(part), len(whole)))
    raise TemplateError(
        f"{name} does not render conversations incrementally (rendering {what} is not a prefix of rendering "
        f"the whole conversation; at character {at}: {part[at : at + 40]!r} vs {whole[at : at + 40]!r}). ft finds "
        "each assistant turn by rendering prefixes, so it cannot build a correct loss mask with it. Templates "
        "that change earlier turns once later ones exist (e.g. dropping past reasoning) or render the last "
        "message differently do this.\n    fix: set data.template to a built-in or to a Jinja file that "
        "renders each message the same way wherever it appears"
    )


def _check_turn(messages, i: int, span: str, head: str, tokenizer, jinja, name: str) -> None:
    """The turn holds the content, an end-of-turn text after it, and no header the model did not write."""
    content = messages[i].get("content")
    if not isinstance(content, str):
        return  # structured content (parts, tool calls): only the prefix checks apply
    content = content.strip()
    pos = span.find(content)
    if pos < 0:
        raise TemplateError(
            f"{name} does not write assistant message {i}'s content inside its turn (rendered turn: "
            f"{span[:80]!r}), so ft cannot tell what to train.\n    fix: use a template that renders each "
            "assistant message's content as given"
        )
    after = span[span.rfind(content) + len(content) :] if content else span
    if not after:
        raise TemplateError(
            f"{name} writes nothing but whitespace after assistant message {i}'s content when it renders "
            f"messages[:{i + 1}], so the model would never learn to end its turn.\n    fix: end every assistant "
            "turn with an end-of-turn token (e.g. eos_token), also the last one"
        )
    if span[:pos].strip() and head == render(messages[:i], tokenizer, jinja):
        raise TemplateError(
            f"{name} adds nothing for add_generation_prompt=True, so the assistant header {span[:pos]!r} would be "
            "trained as if the model wrote it.\n    fix: make the template write the assistant header when "
            "add_generation_prompt is true, or use a built-in"
        )


def _encode(text: str, tokenizer, jinja) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise TemplateError(
            f"loss masking needs a fast tokenizer (with character offsets), but {type(tokenizer).__name__} is slow."
            "\n    fix: load the tokenizer with use_fast=True (a tokenizer.json), or convert it with `tokenizers`"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:2] == [bos, bos]:
        raise TemplateError(
            f"{describe(jinja, tokenizer)} starts with two BOS tokens ({tokenizer.bos_token!r}).\n    fix: write "
            "bos_token once in the template"
        )
    return ids, offsets


def _labels(ids: list[int], offsets, spans: list[tuple[int, int]]) -> list[int]:
    """ids where the token's characters overlap a span, else IGNORE.

    Tokenizers that trim offsets give whitespace-only tokens an empty range at the end of their text;
    such a token at position p is taken to cover the character before p.
    """
    labels = [IGNORE] * len(ids)
    spans = sorted(spans)
    k = 0
    for t, (start, end) in enumerate(offsets):
        if end == start:
            start = max(start - 1, 0)
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0] and start < spans[k][1]:
            labels[t] = ids[t]
    return labels
