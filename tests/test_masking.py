"""Loss masks for every template: exactly the assistant replies and their end-of-turn tokens are trained.

The rule under test (finetune/data/masking.py): an assistant turn is trained from the end of the
generation prompt through its end-of-turn token; the whitespace the template writes after that token
is not trained; a token straddling a span edge is trained.
"""

from __future__ import annotations

import pytest
from tokenizers import processors

from finetune.data.masking import IGNORE, tokenize_continuation, tokenize_conversation, tokenize_prompt
from finetune.errors import DataError
from finetune.templates import BUILTIN, TemplateError, render, resolve
from finetune.tiny import build_tokenizer

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TURNS = [
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42."},
    {"role": "user", "content": "How many numbers please?"},
    {"role": "assistant", "content": "Two numbers."},
    {"role": "user", "content": "Thank you."},
    {"role": "assistant", "content": "The model learns to add."},
]
CONVERSATION = [SYSTEM, *TURNS]
REPLIES = [m["content"] for m in TURNS if m["role"] == "assistant"]

# template -> (text it writes before a reply after the generation prompt, end-of-turn text, generation prompt)
FORMAT = {
    "tokenizer": ("", "<|im_end|>", "<|im_start|>assistant\n"),
    "chatml": ("", "<|im_end|>", "<|im_start|>assistant\n"),
    "qwen": ("", "<|im_end|>", "<|im_start|>assistant\n"),
    "llama3": ("", "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "mistral": (" ", "</s>", "[/INST]"),
    "gemma": ("", "<end_of_turn>", "<start_of_turn>model\n"),
    "phi3": ("", "<|end|>", "<|assistant|>\n"),
    "plain": ("", "<|endoftext|>", "Thank you.\n"),
    "alpaca": ("", "<|endoftext|>", "### Response:\n"),
}
NEVER_TRAINED = [
    "helpful",
    "What is",
    "How many",
    "Thank",
    "user",
    "system",
    "<|im_start|>",
    "<|start_header_id|>",
    "[INST]",
    "[/INST]",
    "<start_of_turn>",
    "<|assistant|>",
    "<|user|>",
    "<|system|>",
    "<bos>",
    "<s>",
    "<|begin_of_text|>",
    "\n",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def runs(tok, ids, labels) -> list[str]:
    """The labelled tokens, decoded, one string per contiguous run."""
    out, current = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE:
            assert label == i
            current.append(i)
        elif current:
            out.append(tok.decode(current))
            current = []
    return out + ([tok.decode(current)] if current else [])


def test_every_builtin_is_covered():
    assert set(FORMAT) == {"tokenizer", *BUILTIN}


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_assistant_turns_and_their_terminators_are_trained(tok, name):
    lead, end, _ = FORMAT[name]
    ids, labels = tokenize_conversation(CONVERSATION, tok, resolve(tok, name))
    assert len(ids) == len(labels)
    assert tok.decode(ids) == render(CONVERSATION, tok, resolve(tok, name))
    assert runs(tok, ids, labels) == [lead + reply + end for reply in REPLIES]
    trained = "".join(runs(tok, ids, labels))
    for text in NEVER_TRAINED:
        assert text not in trained, f"{text!r} was trained"
    terminator = tok.convert_tokens_to_ids(end)
    assert sum(1 for i, label in zip(ids, labels) if i == terminator and label == terminator) == len(REPLIES)


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_last_assistant_trains_only_the_final_turn(tok, name):
    lead, end, _ = FORMAT[name]
    ids, labels = tokenize_conversation(CONVERSATION, tok, resolve(tok, name), train_on="last_assistant")
    assert runs(tok, ids, labels) == [lead + REPLIES[-1] + end]
    assert ids == tokenize_conversation(CONVERSATION, tok, resolve(tok, name))[0]


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_all_trains_every_token(tok, name):
    ids, labels = tokenize_conversation(CONVERSATION, tok, resolve(tok, name), train_on="all")
    assert labels == ids and IGNORE not in labels


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_prompt_ends_with_the_generation_prompt_and_prefixes_the_conversation(tok, name):
    jinja = resolve(tok, name)
    prompt = tokenize_prompt(CONVERSATION[:-1], tok, jinja)
    assert tok.decode(prompt).endswith(FORMAT[name][2])
    full, _ = tokenize_conversation(CONVERSATION, tok, jinja)
    assert full[: len(prompt)] == prompt and len(full) > len(prompt)


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_continuation_trains_only_the_continuation(tok, name):
    lead, end, _ = FORMAT[name]
    jinja = resolve(tok, name)
    ids, labels = tokenize_continuation(CONVERSATION[:-3], CONVERSATION[-3:], tok, jinja)
    assert ids == tokenize_conversation(CONVERSATION, tok, jinja)[0]
    assert runs(tok, ids, labels) == [lead + r + end for r in REPLIES[-2:]]
    prompt = tokenize_prompt(CONVERSATION[:-1], tok, jinja)
    ids, labels = tokenize_continuation(CONVERSATION[:-1], CONVERSATION[-1:], tok, jinja)
    assert ids[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {IGNORE}
    assert runs(tok, ids, labels) == [lead + REPLIES[-1] + end]


def test_continuation_without_an_assistant_message_is_a_data_error(tok):
    with pytest.raises(DataError, match="no assistant message"):
        tokenize_continuation(CONVERSATION[:2], [{"role": "user", "content": "Hi"}], tok, resolve(tok, "chatml"))


def test_mistral_rejects_two_user_turns(tok):
    bad = [TURNS[0], TURNS[2], TURNS[1]]
    with pytest.raises(TemplateError, match="alternate"):
        tokenize_conversation(bad, tok, BUILTIN["mistral"].jinja)


def test_other_roles_are_not_trained(tok):
    conv = [TURNS[0], {"role": "tool", "content": "tool says 42"}, TURNS[1]]
    ids, labels = tokenize_conversation(conv, tok, BUILTIN["chatml"].jinja)
    assert runs(tok, ids, labels) == [REPLIES[0] + "<|im_end|>"]


def test_no_assistant_message_trains_nothing(tok):
    ids, labels = tokenize_conversation([SYSTEM, TURNS[0]], tok, BUILTIN["llama3"].jinja)
    assert ids and set(labels) == {IGNORE}


def test_a_conversation_starting_with_the_assistant_is_a_data_error(tok):
    with pytest.raises(DataError, match="message 0 is an assistant message"):
        tokenize_conversation([TURNS[1], TURNS[0]], tok, BUILTIN["chatml"].jinja)


def test_bad_messages_are_data_errors(tok):
    with pytest.raises(DataError, match="non-empty list"):
        tokenize_conversation([], tok, BUILTIN["chatml"].jinja)
    with pytest.raises(DataError, match="message 1 must be a dict"):
        tokenize_conversation([TURNS[0], {"content": "no role"}], tok, BUILTIN["chatml"].jinja)


# ---------------------------------------------------------------- templates that must fail loudly
LAST_DIFFERENT = (  # the last message gets a different header
    "{% for m in messages %}{{ '<|im_start|>' + ('final' if loop.last else m.role) + '\\n' + m.content + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LAST_UNTERMINATED = (  # the end marker is written only when another message follows
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}{% if not loop.last %}{{ '<|im_end|>\\n' "
    "}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_end|>\\n<|im_start|>assistant\\n' }}{% endif %}"
)
DROPS_PAST_REASONING = (  # Qwen3-style: reasoning is kept only in assistant turns after the last user turn
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{% set c = m.content %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.last_user %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NO_GENERATION_PROMPT = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
)
NO_TERMINATOR = (
    "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
GENERATION_PROMPT_MISMATCH = (  # the generation prompt opens an empty reasoning block the turns never have
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)
DROPS_CONTENT = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role != 'assistant' %}{{ m.content }}{% "
    "endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_renders_the_last_message_differently_fails(tok):
    with pytest.raises(TemplateError, match="does not render conversations incrementally"):
        tokenize_conversation(CONVERSATION, tok, LAST_DIFFERENT)


def test_a_template_that_ends_only_non_final_turns_fails(tok):
    with pytest.raises(TemplateError, match="writes nothing but whitespace after assistant message 2's content"):
        tokenize_conversation(CONVERSATION, tok, LAST_UNTERMINATED)


def test_a_template_that_drops_past_reasoning_fails(tok):
    conv = [TURNS[0], {"role": "assistant", "content": "<think>add</think>42."}, *TURNS[2:4]]
    with pytest.raises(TemplateError, match=r"(?s)a custom template does not render conversations incrementally.*fix"):
        tokenize_conversation(conv, tok, DROPS_PAST_REASONING)


def test_a_template_without_generation_prompt_fails_instead_of_training_the_header(tok):
    with pytest.raises(TemplateError, match="adds nothing for add_generation_prompt"):
        tokenize_conversation(CONVERSATION, tok, NO_GENERATION_PROMPT)


def test_a_template_without_end_of_turn_fails(tok):
    with pytest.raises(TemplateError, match="never learn to end its turn"):
        tokenize_conversation(CONVERSATION, tok, NO_TERMINATOR)


def test_a_generation_prompt_that_is_not_the_turns_start_fails(tok):
    with pytest.raises(TemplateError, match="incrementally"):
        tokenize_conversation(CONVERSATION, tok, GENERATION_PROMPT_MISMATCH)


def test_a_template_that_drops_assistant_content_fails(tok):
    with pytest.raises(TemplateError, match="does not write assistant message 2's content"):
        tokenize_conversation(CONVERSATION, tok, DROPS_CONTENT)


def test_all_needs_no_incremental_template(tok):
    ids, labels = tokenize_conversation(CONVERSATION, tok, LAST_DIFFERENT, train_on="all")
    assert ids == labels


# ---------------------------------------------------------------- tokenization details
def test_a_custom_jinja_file(tok, tmp_path):
    path = tmp_path / "alpaca.jinja"
    path.write_text(
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ '### Response:\\n' + m.content + eos_token + "
        "'\\n\\n' }}{% else %}{{ '### Instruction:\\n' + m.content + '\\n\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    )
    ids, labels = tokenize_conversation(TURNS, tok, resolve(tok, str(path)))
    assert runs(tok, ids, labels) == [r + "<|endoftext|>" for r in REPLIES]


def test_a_token_straddling_the_start_of_a_reply_is_trained(tok):
    # "Answer: " belongs to the prompt, but " the" is one token that starts in it: it must be trained.
    jinja = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{{ 'Answer: ' + m.content + eos_token }}{% else %}{{ "
        "m.content + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Answer: ' }}{% endif %}"
    )
    conv = [TURNS[0], {"role": "assistant", "content": "the model learns to add."}]
    ids, labels = tokenize_conversation(conv, tok, jinja)
    assert tok.convert_ids_to_tokens(ids)[-7] == "Ġthe"
    assert runs(tok, ids, labels) == [" the model learns to add.<|endoftext|>"]


def test_tokenizers_that_trim_offsets_give_the_same_labels(tok):
    trimming = build_tokenizer()
    trimming.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    for name in ("chatml", "mistral", "plain"):
        conv = CONVERSATION + [{"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": " a  b "}]
        assert tokenize_conversation(conv, trimming, BUILTIN[name].jinja) == tokenize_conversation(
            conv, tok, BUILTIN[name].jinja
        )


def test_bos_is_written_once(tok):
    with_bos = build_tokenizer()
    with_bos.bos_token = "<s>"
    ids, labels = tokenize_conversation(TURNS[:2], with_bos, BUILTIN["plain"].jinja)
    assert ids.count(with_bos.bos_token_id) == 1 and ids[0] == with_bos.bos_token_id and labels[0] == IGNORE
    with pytest.raises(TemplateError, match="two BOS"):
        tokenize_conversation(TURNS[:2], with_bos, "{{ bos_token }}" + BUILTIN["plain"].jinja)


def test_a_slow_tokenizer_is_refused(tok):
    class Slow:
        is_fast = False
        chat_template = None

        def apply_chat_template(self, *args, **kwargs):
            return tok.apply_chat_template(*args, **kwargs)

    with pytest.raises(TemplateError, match="fast tokenizer"):
        tokenize_conversation(CONVERSATION, Slow(), BUILTIN["chatml"].jinja)


def test_speed(tok):
    import time

    jinja = BUILTIN["llama3"].jinja
    start = time.perf_counter()
    for _ in range(50):
        tokenize_conversation(CONVERSATION, tok, jinja)
    assert (time.perf_counter() - start) / 50 < 0.05  # about 1 ms here; generous for slow CI machines
