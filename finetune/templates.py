"""Chat templates: the built-in ones, choosing one (`data.template`), and rendering conversations.

A template is a Jinja string in the Hugging Face chat-template dialect: it sees `messages` (dicts with
`role` and `content`), `add_generation_prompt`, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) and `raise_exception(message)`. Rendering goes through the tokenizer's own
`apply_chat_template`, so a built-in renders exactly as the same text would as a model's template.

Every built-in renders conversations *incrementally*: the text of a conversation's first k messages is
a prefix of the text of the whole conversation, and the generation prompt (`add_generation_prompt`) is
exactly the text that starts the next assistant turn. `finetune.data.masking` relies on that to find
each assistant turn, and checks it for any template it is given.

Each assistant turn ends with the template's end-of-turn text, which the model must learn to emit:
chatml/qwen `<|im_end|>`, llama3 `<|eot_id|>`, mistral `</s>`, gemma `<end_of_turn>`, phi3 `<|end|>`,
plain and alpaca the tokenizer's `eos_token`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError

KEY = "data.template"


class TemplateError(FtError):
    """A chat template that cannot be found, rendered, or used to build loss masks."""

    exit_code = 2


@dataclass(frozen=True)
class Template:
    """A built-in chat template."""

    name: str
    jinja: str  # Hugging Face chat-template Jinja
    special_tokens: tuple[str, ...]  # tokens it writes that must be single tokens in the vocabulary


def _alternation_check(name: str) -> str:
    """Jinja that raises unless `turns` alternate user, assistant, user, ... (`offset`: a folded system message)."""
    return (
        "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) or message.role not in ['user', 'assistant'] -%}"
        "{{- raise_exception('the " + name + " template needs user and assistant messages that alternate, starting "
        "with user (a system message may only come first); message ' ~ (loop.index0 + offset) ~ ' has role ' "
        "~ message.role) -}}{%- endif -%}"
    )


# A leading system message is taken out of `turns` and folded into the first user message.
_FOLD_SYSTEM = (
    "{%- if messages[0].role == 'system' -%}"
    "{%- set system = messages[0].content -%}{%- set turns = messages[1:] -%}{%- set offset = 1 -%}{%- else -%}"
    "{%- set system = '' -%}{%- set turns = messages -%}{%- set offset = 0 -%}{%- endif -%}"
)

CHATML = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN = (
    "{%- if messages[0].role != 'system' -%}"
    "{{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}" + CHATML
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}{%- for message in messages -%}{{- '<|start_header_id|>' + message.role + "
    "'<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' -}}{%- endfor -%}{%- if add_generation_prompt "
    "-%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# [INST] style: the prompt ends with [/INST], so the generation prompt adds nothing; the reply starts with a space.
MISTRAL = (
    _FOLD_SYSTEM + "{{- '<s>' -}}"
    "{%- for message in turns -%}" + _alternation_check("mistral") + "{%- if message.role == 'user' -%}"
    "{{- '[INST] ' + (system + '\\n\\n' if loop.first and system else '') + message.content + ' [/INST]' -}}"
    "{%- else -%}{{- ' ' + message.content + '</s>' -}}{%- endif -%}{%- endfor -%}"
)

GEMMA = (
    _FOLD_SYSTEM + "{{- '<bos>' -}}"
    "{%- for message in turns -%}"
    + _alternation_check("gemma")
    + "{%- set role = 'model' if message.role == 'assistant' else 'user' -%}"
    "{%- set prefix = system + '\\n\\n' if loop.first and system else '' -%}"
    "{{- '<start_of_turn>' + role + '\\n' + prefix + (message.content | trim) + '<end_of_turn>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

PHI3 = (
    "{%- for message in messages -%}{%- if message.role not in ['system', 'user', 'assistant'] -%}{{- "
    "raise_exception('the phi3 template knows the roles system, user and assistant; message ' ~ loop.index0 ~ ' has "
    "role ' ~ message.role) -}}{%- endif -%}{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>\\n' -}}{%- "
    "endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# For base models: the tokenizer's BOS (when it has one), then each message's text; replies end with EOS.
PLAIN = (
    "{%- if eos_token is not defined or not eos_token -%}{{- raise_exception('the plain template ends replies with "
    "eos_token, but this tokenizer has none; set one on the tokenizer') -}}{%- endif -%}{%- if bos_token is defined "
    "and bos_token -%}{{- bos_token -}}{%- endif -%}{%- for message in messages -%}{%- if message.role == 'assistant' "
    "-%}{{- message.content + eos_token -}}{%- else -%}{{- message.content + '\\n' -}}{%- endif -%}{%- endfor -%}"
)

# The instruction format's classic prompt (base models). ft's instruction records reach a template as one user message,
# `instruction` or `instruction + "\n\n" + input`: the text up to the first blank line is the instruction, the rest (if
# any) the input. The preamble names the input only when the first request has one; a leading system message replaces
# the preamble; each later user message is a new "### Instruction:" section. Replies end with the tokenizer's EOS.
ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)
ALPACA_PREAMBLE_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request."
)
ALPACA = (
    "{%- if eos_token is not defined or not eos_token -%}{{- raise_exception('the alpaca template ends replies with "
    "eos_token, but this tokenizer has none; set one on the tokenizer') -}}{%- endif -%}"
    + _FOLD_SYSTEM
    + "{%- if bos_token is defined and bos_token -%}{{- bos_token -}}{%- endif -%}"
    "{%- for message in turns -%}" + _alternation_check("alpaca") + "{%- if message.role == 'user' -%}"
    "{%- set parts = message.content.split('\\n\\n', 1) -%}"
    "{%- set has_input = parts | length > 1 and parts[1] | trim -%}"
    "{%- if loop.first -%}{{- (system or ('"
    + ALPACA_PREAMBLE_INPUT
    + "' if has_input else '"
    + ALPACA_PREAMBLE
    + "')) + '\\n\\n' -}}{%- else -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '### Instruction:\\n' + parts[0] + '\\n\\n' -}}"
    "{%- if has_input -%}{{- '### Input:\\n' + parts[1] + '\\n\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '### Response:\\n' + message.content + eos_token -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '### Response:\\n' -}}{%- endif -%}"
)

BUILTIN: dict[str, Template] = {
    t.name: t
    for t in (
        Template("chatml", CHATML, ("<|im_start|>", "<|im_end|>")),
        Template("qwen", QWEN, ("<|im_start|>", "<|im_end|>")),
        Template("llama3", LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
        Template("mistral", MISTRAL, ("<s>", "</s>", "[INST]", "[/INST]")),
        Template("gemma", GEMMA, ("<bos>", "<start_of_turn>", "<end_of_turn>")),
        Template("phi3", PHI3, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")),
        Template("plain", PLAIN, ()),
        Template("alpaca", ALPACA, ()),
    )
}

_NAMES = ", ".join(BUILTIN)


def _tokenizer_template(tokenizer) -> str:
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one is the chat template
        own = own.get("default")
    if not own:
        raise TemplateError(
            f"{KEY}: `tokenizer` asks for the tokenizer's own chat template, but this tokenizer has none "
            f"(a base model?).\n    fix: set {KEY} to a built-in ({_NAMES}; `plain` suits base models) "
            "or to the path of a .jinja file"
        )
    return own


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or "\\" in spec or spec.startswith("~") or Path(spec).suffix in (".jinja", ".j2", ".txt")


def resolve(tokenizer, spec: str) -> str:
    """The Jinja source for `data.template`: `tokenizer`, a built-in name, or a path to a Jinja file."""
    if spec == "tokenizer":
        return _tokenizer_template(tokenizer)
    if spec in BUILTIN:
        return BUILTIN[spec].jinja
    path = Path(spec).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise TemplateError(
                f"{KEY}: the template file {path} is empty.\n    fix: write a Jinja chat template in it"
            )
        return text
    if _looks_like_path(spec):
        raise TemplateError(
            f"{KEY}: the template file {path} does not exist.\n    fix: correct the path, "
            f"or use `tokenizer` or a built-in ({_NAMES})"
        )
    close = difflib.get_close_matches(spec.lower(), ["tokenizer", *BUILTIN], n=1, cutoff=0.5)
    hint = f"did you mean `{close[0]}`? Otherwise " if close else ""
    raise TemplateError(
        f"{KEY}: unknown template `{spec}` (not a built-in, and no file of that name).\n"
        f"    fix: {hint}use `tokenizer`, a built-in ({_NAMES}) or the path of a .jinja file"
    )


def is_single_token(tokenizer, token: str) -> bool:
    """Whether `token` encodes to exactly one id (an added/special token) in this tokenizer."""
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    return len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == token


def missing_special_tokens(tokenizer, spec: str) -> list[str]:
    """The built-in template's tokens that this tokenizer splits into pieces (empty for other specs).

    The caller adds them (`tokenizer.add_tokens(missing, special_tokens=True)`) and resizes the model's
    embeddings. For `tokenizer` and for files ft cannot know the tokens: use `data.add_special_tokens`.
    """
    template = BUILTIN.get(spec)
    if template is None:
        return []
    return [tok for tok in template.special_tokens if not is_single_token(tokenizer, tok)]


def describe(jinja: str, tokenizer=None) -> str:
    """How messages name a template: "the `chatml` template", "the tokenizer's own template", "a custom template"."""
    for template in BUILTIN.values():
        if template.jinja == jinja:
            return f"the `{template.name}` template"
    if tokenizer is not None and getattr(tokenizer, "chat_template", None) == jinja:
        return "the tokenizer's own template"
    return "a custom template"


def render(messages: list[dict], tokenizer, jinja: str, add_generation_prompt: bool = False) -> str:
    """The conversation as text, by `tokenizer.apply_chat_template`; template failures -> TemplateError."""
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=jinja, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except jinja2.TemplateError as exc:  # raise_exception(), syntax errors, undefined names
        raise TemplateError(f"{describe(jinja, tokenizer)} rejected the conversation: {exc.message or exc}") from exc
    except (TypeError, ValueError) as exc:  # e.g. content that is not text, an empty conversation
        raise TemplateError(f"{describe(jinja, tokenizer)} could not render the conversation: {exc}") from exc
    if not isinstance(text, str):
        raise TemplateError(f"{describe(jinja, tokenizer)} did not render to text (got {type(text).__name__})")
    return text
