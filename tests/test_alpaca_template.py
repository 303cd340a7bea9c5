"""The built-in `alpaca` template: the instruction format's classic prompt, with only the response (and EOS) trained."""

from __future__ import annotations

import pytest

from finetune.data.formats import normalize
from finetune.data.masking import IGNORE, tokenize_conversation, tokenize_prompt
from finetune.templates import BUILTIN, TemplateError, render, resolve
from finetune.tiny import build_tokenizer
from tests.helpers import spec

PREAMBLE = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
PREAMBLE_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
WITHOUT_INPUT = {"instruction": "Add the two numbers.", "input": "", "output": "12 + 30 = 42."}
WITH_INPUT = {"instruction": "Add the two numbers.", "input": "12 and 30", "output": "12 + 30 = 42."}
# What the template renders for each record: written out by hand from the format's description.
EXPECTED = {
    "without input": PREAMBLE
    + "\n\n### Instruction:\nAdd the two numbers.\n\n### Response:\n12 + 30 = 42.<|endoftext|>",
    "with input": PREAMBLE_INPUT + "\n\n### Instruction:\nAdd the two numbers.\n\n### Input:\n12 and 30\n\n"
    "### Response:\n12 + 30 = 42.<|endoftext|>",
}
RECORDS = {"without input": WITHOUT_INPUT, "with input": WITH_INPUT}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def messages(record: dict, **kw) -> list[dict]:
    """The record as ft's instruction format turns it into messages."""
    return normalize(record, spec("data.jsonl", "instruction", **kw))["messages"]


def trained(tok, ids, labels) -> list[str]:
    """The labelled tokens, decoded, one string per contiguous run."""
    runs, current = [], []
    for i, label in zip(ids, labels):
        if label != IGNORE:
            assert label == i
            current.append(i)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_instruction_records_render_as_the_alpaca_prompt(tok, case):
    assert resolve(tok, "alpaca") == BUILTIN["alpaca"].jinja
    assert render(messages(RECORDS[case]), tok, BUILTIN["alpaca"].jinja) == EXPECTED[case]


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_only_the_response_and_eos_are_trained(tok, case):
    ids, labels = tokenize_conversation(messages(RECORDS[case]), tok, BUILTIN["alpaca"].jinja)
    assert tok.decode(ids) == EXPECTED[case]
    assert trained(tok, ids, labels) == ["12 + 30 = 42.<|endoftext|>"]
    reply = tok("12 + 30 = 42.<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids[-len(reply) :] == reply and sum(label != IGNORE for label in labels) == len(reply)


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_the_generation_prompt_ends_with_the_response_header(tok, case):
    conversation = messages(RECORDS[case])
    jinja = BUILTIN["alpaca"].jinja
    prompt_text = render(conversation[:-1], tok, jinja, add_generation_prompt=True)
    assert prompt_text == EXPECTED[case].removesuffix("12 + 30 = 42.<|endoftext|>")
    assert prompt_text.endswith("### Response:\n")
    prompt = tokenize_prompt(conversation[:-1], tok, jinja)
    full, labels = tokenize_conversation(conversation, tok, jinja)
    assert full[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {IGNORE}


def test_a_system_message_replaces_the_preamble(tok):
    conversation = messages(WITH_INPUT, system_prompt="You add numbers.")
    text = render(conversation, tok, BUILTIN["alpaca"].jinja)
    assert text == "You add numbers." + EXPECTED["with input"].removeprefix(PREAMBLE_INPUT)
    ids, labels = tokenize_conversation(conversation, tok, BUILTIN["alpaca"].jinja)
    assert trained(tok, ids, labels) == ["12 + 30 = 42.<|endoftext|>"]


def test_later_turns_become_new_instructions_and_every_reply_is_trained(tok):
    conversation = messages(WITHOUT_INPUT) + [
        {"role": "user", "content": "Now subtract them."},
        {"role": "assistant", "content": "30 - 12 = 18."},
    ]
    text = render(conversation, tok, BUILTIN["alpaca"].jinja)
    assert text == EXPECTED["without input"] + "\n\n### Instruction:\nNow subtract them.\n\n### Response:\n" + (
        "30 - 12 = 18.<|endoftext|>"
    )
    ids, labels = tokenize_conversation(conversation, tok, BUILTIN["alpaca"].jinja)
    assert trained(tok, ids, labels) == ["12 + 30 = 42.<|endoftext|>", "30 - 12 = 18.<|endoftext|>"]


def test_roles_out_of_turn_are_refused_with_their_position(tok):
    with pytest.raises(TemplateError, match=r"`alpaca` template rejected.*alternate.*message 1 has role user"):
        render([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}], tok, BUILTIN["alpaca"].jinja)
    with pytest.raises(TemplateError, match="message 2 has role tool"):
        render(messages(WITHOUT_INPUT) + [{"role": "tool", "content": "42"}], tok, BUILTIN["alpaca"].jinja)


def test_a_tokenizer_without_eos_is_refused(tok):
    bare = build_tokenizer()
    bare.eos_token = None
    with pytest.raises(TemplateError, match="alpaca template ends replies with eos_token"):
        render(messages(WITHOUT_INPUT), bare, BUILTIN["alpaca"].jinja)


def test_prepared_data_with_template_alpaca_trains_only_the_responses(tmp_path):
    from finetune.config import loads
    from finetune.data.preprocess import prepare
    from finetune.tiny import write_jsonl

    data = write_jsonl([WITHOUT_INPUT, WITH_INPUT] * 4, tmp_path / "alpaca.jsonl")
    config = loads(f"""
model: {{name: ft-tiny}}
data: {{datasets: [{{path: {data}, format: instruction}}], template: alpaca, seq_len: 512, cache_dir: {tmp_path / "c"}}}
adapter: {{type: lora}}
train: {{global_batch_size: 4, max_steps: 1}}
output: {{dir: {tmp_path / "run"}}}
""")
    prepared = prepare(config)
    tok = prepared.tokenizer
    rows = prepared.train
    assert len(rows) == 8
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        assert tok.decode(ids) in EXPECTED.values()
        assert trained(tok, ids, labels) == ["12 + 30 = 42.<|endoftext|>"]
