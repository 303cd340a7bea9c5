"""Each format's canonical shape, its bad-record messages, and normalize_dataset's strict and skip modes."""

from __future__ import annotations

import json

import datasets
import pytest

from finetune.config import checks
from finetune.config.schema import DatasetSpec
from finetune.data.formats import FIELDS, RecordError, features, normalize, normalize_dataset
from finetune.errors import DataError

datasets.disable_progress_bars()


def spec(fmt, **kw) -> DatasetSpec:
    return DatasetSpec(path="data/train.jsonl", format=fmt, **kw)


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def test_fields_agree_with_the_config_checks():
    assert {k: set(v) for k, v in FIELDS.items()} == checks.FIELDS


# ---------------------------------------------------------------- chat
def test_chat_openai_style_keeps_origin():
    record = {"messages": [user("hi"), bot("hello")], "_origin": "f.jsonl:3"}
    expected = {"messages": [user("hi"), bot("hello")], "images": [], "_origin": "f.jsonl:3"}
    assert normalize(record, spec("chat")) == expected


def test_chat_sharegpt_conversations_are_detected():
    record = {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "yo"},
            {"from": "function", "value": "{}"},
            {"from": "model", "value": "done"},
        ]
    }
    out = normalize(record, spec("chat"))
    assert out["messages"] == [
        system("be brief"),
        user("hi"),
        bot("yo"),
        {"role": "tool", "content": "{}"},
        bot("done"),
    ]


def test_chat_styles_mix_per_message_and_map_columns():
    record = {"dialog": [{"from": "Human", "value": "hi"}, {"role": "bot", "content": "yo"}]}
    assert normalize(record, spec("chat", columns={"messages": "dialog"}))["messages"] == [user("hi"), bot("yo")]


def test_chat_system_column_and_system_prompt():
    record = {"messages": [user("hi"), bot("yo")], "sys": "from the column"}
    assert normalize(record, spec("chat", columns={"system": "sys"}))["messages"][0] == system("from the column")
    plain = {"messages": [user("hi"), bot("yo")]}
    assert normalize(plain, spec("chat", system_prompt="default"))["messages"] == [
        system("default"),
        user("hi"),
        bot("yo"),
    ]
    own = {"messages": [system("own"), user("hi"), bot("yo")]}
    assert normalize(own, spec("chat", system_prompt="default"))["messages"] == own["messages"]


def test_chat_conversation_as_json_text():
    record = {"messages": json.dumps([user("hi"), bot("yo")])}
    assert normalize(record, spec("chat"))["messages"] == [user("hi"), bot("yo")]


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], r"'messages' is an empty conversation"),
        ("hello", r"'messages' must be a list of messages, got a string"),
        (
            [user("hi"), {"text": "yo"}],
            r"message messages\[1\] has no role: expected role/content .* keys present: text",
        ),
        ([user("hi"), {"role": "narrator", "content": "x"}], r"message messages\[1\] has an unknown role 'narrator'"),
        (
            [user("hi"), {"role": "assistant", "content": ["parts"]}],
            r"message messages\[1\] \(assistant\): part 0 must be \{\"type\": \"text\"",
        ),
        ([user("hi"), {"from": "gpt"}], r"message messages\[1\] \(gpt\) has no 'value'"),
        ([user("hi"), user("anyone?")], r"'messages' has no assistant message"),
    ],
)
def test_chat_bad_records(messages, message):
    with pytest.raises(RecordError, match=message):
        normalize({"messages": messages}, spec("chat"))


# ---------------------------------------------------------------- instruction, completion, prompt_completion
def test_instruction_with_and_without_input():
    s = spec("instruction", system_prompt="You help.")
    with_input = normalize({"instruction": "Translate", "input": "chat", "output": "cat"}, s)
    assert with_input["messages"] == [system("You help."), user("Translate\n\nchat"), bot("cat")]
    for record in ({"instruction": "Greet", "input": "", "output": "hi"}, {"instruction": "Greet", "output": "hi"}):
        assert normalize(record, spec("instruction"))["messages"] == [user("Greet"), bot("hi")]


def test_instruction_mapped_columns_and_system_column():
    s = spec("instruction", columns={"output": "response", "system": "sys"})
    out = normalize({"instruction": "Q", "response": "A", "sys": "S"}, s)
    assert out["messages"] == [system("S"), user("Q"), bot("A")]


def test_missing_column_lists_present_columns_and_suggests_a_mapping():
    with pytest.raises(RecordError) as e:
        normalize({"instruction": "Q", "response": "A", "_origin": "x:1"}, spec("instruction"))
    assert str(e.value) == (
        "no column 'output' (mapped from ft field 'output'); columns present: instruction, response; "
        "map it with columns: {output: response}"
    )


def test_completion_and_prompt_completion():
    assert normalize({"text": "a document"}, spec("completion")) == {"text": "a document"}
    assert normalize({"q": "2+2=", "completion": "4"}, spec("prompt_completion", columns={"prompt": "q"})) == {
        "prompt": "2+2=",
        "completion": "4",
    }
    with pytest.raises(RecordError, match=r"'text' is empty"):
        normalize({"text": "  "}, spec("completion"))
    with pytest.raises(RecordError, match=r"'completion' must be text, got a number"):
        normalize({"prompt": "p", "completion": 4}, spec("prompt_completion"))
    with pytest.raises(RecordError, match=r"'completion' is null"):
        normalize({"prompt": "p", "completion": None}, spec("prompt_completion"))


# ---------------------------------------------------------------- preference
def test_preference_strings():
    out = normalize({"prompt": "Q?", "chosen": "good", "rejected": "bad"}, spec("preference", system_prompt="S"))
    assert out == {"prompt": [system("S"), user("Q?")], "chosen": [bot("good")], "rejected": [bot("bad")]}


def test_preference_strips_the_shared_prompt_prefix():
    prompt = [user("Q?")]
    record = {
        "prompt": prompt,
        "chosen": prompt + [bot("good")],
        "rejected": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "bad"}],
    }
    out = normalize(record, spec("preference"))
    assert out == {"prompt": [user("Q?")], "chosen": [bot("good")], "rejected": [bot("bad")]}


def test_preference_prompt_from_shared_leading_messages():
    chosen = [user("Q?"), bot("A"), user("more?"), bot("good")]
    rejected = chosen[:3] + [bot("bad")]
    out = normalize({"chosen": chosen, "rejected": rejected}, spec("preference"))
    assert out == {"prompt": chosen[:3], "chosen": [bot("good")], "rejected": [bot("bad")]}


def test_preference_bad_records():
    with pytest.raises(
        RecordError,
        match=r"no column 'rejected' .*columns present: prompt, chosen, worse; "
        r"map it with columns: \{rejected: worse\}",
    ):
        normalize({"prompt": "Q", "chosen": "a", "worse": "b"}, spec("preference"))
    with pytest.raises(RecordError, match=r"'chosen' has no assistant message after the prompt"):
        normalize({"prompt": [user("Q")], "chosen": [user("Q")], "rejected": "b"}, spec("preference"))
    with pytest.raises(RecordError, match=r"no column 'prompt'"):
        normalize({"chosen": "a", "rejected": "b"}, spec("preference"))


# ---------------------------------------------------------------- prompt_only
def test_prompt_only_keeps_other_columns_as_extra():
    record = {"question": "2+2?", "answer": 4, "source": "gsm", "_origin": "g.jsonl:1"}
    out = normalize(record, spec("prompt_only", columns={"prompt": "question"}, system_prompt="Think."))
    assert out["prompt"] == [system("Think."), user("2+2?")]
    assert json.loads(out["extra"]) == {"answer": 4, "source": "gsm"}
    assert out["_origin"] == "g.jsonl:1"


def test_prompt_only_accepts_messages():
    out = normalize({"prompt": [user("hi")], "answer": "x"}, spec("prompt_only"))
    assert out["prompt"] == [user("hi")] and json.loads(out["extra"]) == {"answer": "x"}


# ---------------------------------------------------------------- normalize_dataset
def dataset(records):
    """Records as load_source builds them (mixed-type columns as exact JSON)."""
    from finetune.data.sources import to_dataset

    return to_dataset([dict(r, _origin=f"data/train.jsonl:{i + 1}") for i, r in enumerate(records)])


GOOD = {"messages": [user("hi"), bot("yo")]}
BAD = {"messages": [user("hi"), user("again")]}


def test_normalize_dataset_shape_and_arrow_nulls():
    ds = dataset([GOOD, {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}])
    out, skipped = normalize_dataset(ds, spec("chat"))
    assert skipped == 0 and out.features == features("chat")
    assert out["messages"][:] == [GOOD["messages"]] * 2
    assert out["_origin"][:] == ["data/train.jsonl:1", "data/train.jsonl:2"]


def test_normalize_dataset_error_names_origin_and_source():
    with pytest.raises(DataError) as e:
        normalize_dataset(dataset([GOOD, GOOD, BAD]), spec("chat"), key="data.datasets[1]")
    msg = str(e.value)
    assert msg.startswith("data/train.jsonl:3: 'messages' has no assistant message")
    assert "data.datasets[1] (path data/train.jsonl, format chat)" in msg and "data.skip_bad_records: true" in msg


def test_normalize_dataset_skips_and_counts():
    out, skipped = normalize_dataset(dataset([GOOD, BAD, GOOD, BAD]), spec("chat"), skip_bad_records=True)
    assert (len(out), skipped) == (2, 2)
    assert out["_origin"][:] == ["data/train.jsonl:1", "data/train.jsonl:3"]


def test_missing_column_raises_even_when_skipping():
    ds = dataset([{"instruction": "Q", "response": "A"}] * 3)
    with pytest.raises(DataError, match=r"data/train.jsonl:1: no column 'output'.*\{output: response\}"):
        normalize_dataset(ds, spec("instruction"), skip_bad_records=True)


def test_mixed_type_column_gives_per_record_errors():
    ds = dataset([GOOD, {"messages": [user("hi"), {"role": "assistant", "content": [{"type": "text"}]}]}])
    out, skipped = normalize_dataset(ds, spec("chat"), skip_bad_records=True)
    assert (len(out), skipped) == (1, 1)


def test_normalize_dataset_in_two_processes():
    out, skipped = normalize_dataset(dataset([GOOD, BAD] * 4), spec("chat"), skip_bad_records=True, num_proc=2)
    assert (len(out), skipped) == (4, 4)


def test_every_record_bad_is_an_error_even_when_skipping():
    with pytest.raises(DataError) as e:
        normalize_dataset(dataset([BAD, BAD, BAD]), spec("chat"), skip_bad_records=True, key="data.datasets[0]")
    msg = str(e.value)
    assert msg.startswith("data/train.jsonl:1: 'messages' has no assistant message")
    assert "every record is bad (3 skipped)" in msg and "data/train.jsonl:2" in msg and "\n    fix: " in msg


def test_skipped_records_are_named_and_reported(caplog):
    examples: list[str] = []
    seen = []
    out, skipped = normalize_dataset(
        dataset([GOOD, BAD, GOOD, BAD]),
        spec("chat"),
        skip_bad_records=True,
        examples=examples,
        progress=lambda stage, done, total: seen.append((done, total)),
    )
    assert skipped == 2 and examples == [
        "data/train.jsonl:2: 'messages' has no assistant message, so there is nothing to train on",
        "data/train.jsonl:4: 'messages' has no assistant message, so there is nothing to train on",
    ]
    assert "skipped 2 bad records" in caplog.text and "data/train.jsonl:2" in caplog.text
    assert seen[-1] == (4, 4)


def test_a_number_among_text_answers_spoils_only_its_own_record():
    records = [{"messages": [user(f"{i} + 1?"), bot(str(i + 1))]} for i in range(40)]
    records[30]["messages"][1]["content"] = 31
    with pytest.raises(
        DataError,
        match=r"^data/train.jsonl:31: message messages\[1\] \(assistant\): 'content' must be a string, got a number",
    ):
        normalize_dataset(dataset(records), spec("chat"))
    out, skipped = normalize_dataset(dataset(records), spec("chat"), skip_bad_records=True)
    assert skipped == 1 and out["messages"][0][1]["content"] == "1"


def test_a_null_column_from_other_records_gives_way_to_an_alias():
    ds = dataset([GOOD, {"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}])
    with pytest.raises(DataError, match=r"train.jsonl:2: message conversations\[1\] has an unknown role 'robot'"):
        normalize_dataset(ds, spec("chat"))
