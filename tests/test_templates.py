"""Built-in chat templates, choosing one (`data.template`), rendering and special tokens."""

from __future__ import annotations

import pytest

from finetune.errors import FtError
from finetune.templates import BUILTIN, TemplateError, describe, missing_special_tokens, render, resolve
from finetune.tiny import CHATML, build_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6."},
]

# What each built-in renders for CONVERSATION: written out by hand, from each format's definition.
EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
    "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
    "<|im_start|>assistant\n6.<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n4.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nAnd 3 + 3?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n6.<|eot_id|>",
    "mistral": "<s>[INST] Be brief.\n\nWhat is 2 + 2? [/INST] 4.</s>[INST] And 3 + 3? [/INST] 6.</s>",
    "gemma": "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2 + 2?<end_of_turn>\n"
    "<start_of_turn>model\n4.<end_of_turn>\n"
    "<start_of_turn>user\nAnd 3 + 3?<end_of_turn>\n<start_of_turn>model\n6.<end_of_turn>\n",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is 2 + 2?<|end|>\n<|assistant|>\n4.<|end|>\n"
    "<|user|>\nAnd 3 + 3?<|end|>\n<|assistant|>\n6.<|end|>\n",
    "plain": "Be brief.\nWhat is 2 + 2?\n4.<|endoftext|>And 3 + 3?\n6.<|endoftext|>",
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_builtins_are_the_documented_set():
    assert {"chatml", "qwen", "llama3", "mistral", "gemma", "phi3", "plain"} <= set(BUILTIN)
    for name, template in BUILTIN.items():
        assert template.name == name and template.jinja


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_builtin_renders_its_format(tok, name):
    assert render(CONVERSATION, tok, BUILTIN[name].jinja) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_special_tokens_are_single_tokens_in_the_rendering(tok, name):
    template = BUILTIN[name]
    text = render(CONVERSATION, tok, template.jinja)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    for special in template.special_tokens:
        assert special in text and special in pieces


def test_qwen_adds_its_default_system_message_only_when_none_is_given(tok):
    without = render(CONVERSATION[1:], tok, BUILTIN["qwen"].jinja)
    assert without.startswith(
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    assert without.endswith(EXPECTED["chatml"].split("<|im_end|>\n", 1)[1])
    assert render(CONVERSATION, tok, BUILTIN["qwen"].jinja) == EXPECTED["chatml"]


@pytest.mark.parametrize("name", ["mistral", "gemma"])
def test_alternating_templates_reject_two_user_turns(tok, name):
    bad = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"}]
    with pytest.raises(TemplateError, match=rf"`{name}` template rejected.*alternate.*message 1 has role user"):
        render(bad, tok, BUILTIN[name].jinja)


def test_mistral_rejects_a_system_message_after_the_first(tok):
    bad = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "system", "content": "x"},
    ]
    with pytest.raises(TemplateError, match="message 2 has role system"):
        render(bad, tok, BUILTIN["mistral"].jinja)


def test_phi3_rejects_unknown_roles(tok):
    with pytest.raises(TemplateError, match="message 0 has role tool"):
        render([{"role": "tool", "content": "42"}], tok, BUILTIN["phi3"].jinja)


def test_plain_writes_the_tokenizers_bos_once(tok):
    with_bos = build_tokenizer()
    with_bos.bos_token = "<s>"
    text = render(CONVERSATION[1:3], with_bos, BUILTIN["plain"].jinja)
    assert text == "<s>What is 2 + 2?\n4.<|endoftext|>"


def test_generation_prompt(tok):
    prompt = CONVERSATION[:2]
    assert render(prompt, tok, BUILTIN["llama3"].jinja, add_generation_prompt=True).endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(prompt, tok, BUILTIN["mistral"].jinja, add_generation_prompt=True).endswith("[/INST]")


def test_template_syntax_error_is_a_template_error(tok):
    with pytest.raises(TemplateError, match="a custom template"):
        render(CONVERSATION, tok, "{% for m in messages %}{{ m.content }")


# ---------------------------------------------------------------- resolve
def test_resolve_tokenizer_builtin_and_file(tok, tmp_path):
    assert resolve(tok, "tokenizer") == CHATML
    assert resolve(tok, "llama3") == BUILTIN["llama3"].jinja
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert resolve(tok, str(path)) == path.read_text()
    assert describe(resolve(tok, str(path)), tok) == "a custom template"
    assert describe(CHATML, tok) == "the tokenizer's own template"


def test_resolve_without_a_tokenizer_template_names_the_key_and_the_builtins():
    base = build_tokenizer()
    base.chat_template = None
    with pytest.raises(TemplateError) as info:
        resolve(base, "tokenizer")
    message = str(info.value)
    assert "data.template" in message and "has none" in message
    assert all(name in message for name in BUILTIN)
    assert isinstance(info.value, FtError)


def test_resolve_unknown_name_suggests(tok):
    with pytest.raises(TemplateError, match=r"(?s)unknown template `lama3`.*did you mean `llama3`"):
        resolve(tok, "lama3")


def test_resolve_missing_file_names_the_path(tok, tmp_path):
    missing = tmp_path / "nope.jinja"
    with pytest.raises(TemplateError, match=f"{missing}.*does not exist"):
        resolve(tok, str(missing))


# ---------------------------------------------------------------- special tokens
def test_missing_special_tokens(tok):
    for name in BUILTIN:
        assert missing_special_tokens(tok, name) == []
    bare = build_tokenizer(extra_special=())
    assert missing_special_tokens(bare, "llama3") == list(BUILTIN["llama3"].special_tokens)
    assert missing_special_tokens(bare, "chatml") == ["<|im_start|>", "<|im_end|>"]
    assert missing_special_tokens(bare, "plain") == []
    assert missing_special_tokens(bare, "tokenizer") == []


def test_adding_the_missing_tokens_makes_them_single(tok):
    bare = build_tokenizer(extra_special=())
    bare.add_tokens(missing_special_tokens(bare, "gemma"), special_tokens=True)
    assert missing_special_tokens(bare, "gemma") == []
