"""An Ollama Modelfile for an exported GGUF file: FROM the file, the job's chat template as a Go template, its stops.

The job's template (data.template: a built-in, the tokenizer's own or a file) is matched to one of ft's built-ins by
what it writes: it maps when it renders a few probe conversations exactly as the built-in does (ft-tiny's own
template is ChatML written otherwise, and maps to chatml). Each built-in that maps has its Go template here, which
writes what the Jinja one writes for conversations of system, user and assistant messages; `plain` and `alpaca`
(base-model prompts) and templates that match none get no TEMPLATE line: Ollama then falls back to the template it
reads from the GGUF file's tokenizer.chat_template, where it recognises it.
"""

from __future__ import annotations

from finetune.errors import FtError

# Ollama gives a template .Messages (.Role, .Content; system messages among them) and .System (every system message,
# joined): templates that fold the system message into the first user turn (mistral, gemma) take it from .System.
_CHATML_TURNS = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"
)
GO_TEMPLATES = {
    "chatml": _CHATML_TURNS,
    "qwen": '{{- if or (not .Messages) (ne (index .Messages 0).Role "system") }}<|im_start|>system\n'
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{{ end }}" + _CHATML_TURNS,
    "llama3": "<|begin_of_text|>{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n"
    "{{ .Content }}<|eot_id|>{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": '<s>{{- $first := true }}{{- range .Messages }}{{- if eq .Role "user" }}[INST] '
    "{{ if and $first $.System }}{{ $.System }}\n\n{{ end }}{{ .Content }} [/INST]{{ $first = false }}"
    '{{- else if eq .Role "assistant" }} {{ .Content }}</s>{{- end }}{{- end }}',
    "gemma": '<bos>{{- $first := true }}{{- range .Messages }}{{- if ne .Role "system" }}<start_of_turn>'
    '{{ if eq .Role "assistant" }}model{{ else }}user{{ end }}\n{{ if and $first $.System }}{{ $.System }}\n\n{{ end }}'
    "{{ .Content }}<end_of_turn>\n{{ $first = false }}{{ end }}{{- end }}<start_of_turn>model\n",
    "phi3": "{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n",
}
STOPS = {
    "chatml": ("<|im_end|>", "<|im_start|>"),
    "qwen": ("<|im_end|>", "<|im_start|>"),
    "llama3": ("<|eot_id|>", "<|start_header_id|>"),
    "mistral": ("</s>", "[INST]"),
    "gemma": ("<end_of_turn>", "<start_of_turn>"),
    "phi3": ("<|end|>", "<|user|>"),
}
PROBES = (
    [{"role": "user", "content": "What is 2 + 3?"}],
    [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
    ],
)


def builtin_for(jinja: str | None, tokenizer) -> str | None:
    """The name of ft's built-in template that `jinja` writes exactly as (on probe conversations), else None."""
    from finetune.templates import BUILTIN, render

    if not jinja:
        return None
    for name, template in BUILTIN.items():
        if template.jinja == jinja:
            return name
    for name, template in BUILTIN.items():
        try:
            same = all(
                render(list(probe), tokenizer, jinja, add_generation_prompt=prompt)
                == render(list(probe), tokenizer, template.jinja, add_generation_prompt=prompt)
                for probe in PROBES
                for prompt in (True, False)
            )
        except FtError:
            same = False
        if same:
            return name
    return None


def end_of_turn(name: str | None) -> str | None:
    """The token that ends an assistant turn in a built-in template (None where it is the tokenizer's EOS)."""
    return STOPS[name][0] if name in STOPS else None


def _quoted(text: str) -> str:
    if '"""' in text:
        raise FtError('a chat template holding """ cannot be written into a Modelfile')
    return f'"""{text}"""'


def modelfile(gguf_name: str, template: str | None, eos: str | None) -> str:
    """The Modelfile's text: FROM ./gguf_name, then the Go template and stops of built-in `template` (when it has
    them; else the tokenizer's EOS as the only stop)."""
    lines = [
        "# Written by ft export. Create the model with: ollama create NAME -f Modelfile",
        f"FROM ./{gguf_name}",
    ]
    if template in GO_TEMPLATES:
        lines.append(f"TEMPLATE {_quoted(GO_TEMPLATES[template])}")
        stops = STOPS[template]
    else:
        lines.append(
            f"# the job's chat template ({template or 'a template ft has no Go version of'}) has no TEMPLATE here: "
            "Ollama uses the one it reads from the GGUF file, where it recognises it"
        )
        stops = ()
    for stop in dict.fromkeys([*stops, *([eos] if eos and template not in GO_TEMPLATES else [])]):
        lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n"
