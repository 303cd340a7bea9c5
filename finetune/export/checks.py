"""What ft checks on a GGUF file it wrote, by loading it with llama.cpp (llama-cpp-python, on the CPU).

The tokenizer: llama.cpp must turn the probe texts (the job's chat template rendered on a few conversations, and
text with digits, punctuation and line breaks) into the same token ids as transformers' tokenizer; a file that
tokenizes otherwise is not published. The model: next-token logits of llama.cpp and of the merged transformers
model on a few token sequences, compared (largest absolute difference, and how often the top token agrees).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError

TEXTS = (
    "What is 12 + 345? The answer is 357.",
    "Reverse 9081:  1809!\nthe model learns, and answers -- quickly.\n\n  done",
)
CHECK_LEN = 16


@dataclass(frozen=True)
class Checked:
    texts: int  # probe texts tokenized identically
    max_abs_logit_diff: float
    top_token_agreement: float  # fraction of positions where both pick the same next token


def probe_texts(tokenizer, jinja: str | None) -> list[str]:
    from finetune.export.ollama import PROBES
    from finetune.templates import render

    rendered = []
    if jinja:
        for probe in PROBES:
            try:
                rendered.append(render(list(probe), tokenizer, jinja, add_generation_prompt=True))
            except FtError:
                continue  # a template that refuses a system message, say: the other probes still run
    return [*rendered, *TEXTS]


def _tokens_differ(llm, tokenizer, texts: list[str]) -> str | None:
    for text in texts:
        ours = tokenizer(text)["input_ids"]
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        if list(theirs) != list(ours):
            return f"{text!r}: transformers {ours[:24]}, llama.cpp {list(theirs)[:24]}"
    return None


def check(path: Path, model, tokenizer, jinja: str | None, threads: int | None = None) -> Checked:
    """Load `path` with llama.cpp and compare it with `model` and `tokenizer`; FtError when tokenization differs."""
    import torch

    from finetune.export.quantize import llama_cpp

    module = llama_cpp()
    texts = probe_texts(tokenizer, jinja)
    llm = module.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=threads)
    try:
        differ = _tokens_differ(llm, tokenizer, texts)
        if differ:
            raise FtError(
                f"llama.cpp tokenizes text otherwise than the model's tokenizer does, so the GGUF file was not "
                f"written: {differ}\n    fix: report this with the tokenizer (tokenizer.json); meanwhile convert "
                "the model with llama.cpp's own converter"
            )
        rows = model.get_input_embeddings().weight.shape[0]
        tokens = torch.randint(0, len(tokenizer), (CHECK_LEN,), generator=torch.Generator().manual_seed(0))
        llm.reset()
        llm.eval(tokens.tolist())
        theirs = torch.tensor(llm.scores[:CHECK_LEN, :rows])
        with torch.no_grad():
            ours = model(input_ids=tokens[None].to(model.device)).logits[0].float().cpu()
    finally:
        llm.close()
    diff = float((theirs - ours).abs().max())
    agree = float((theirs.argmax(-1) == ours.argmax(-1)).float().mean())
    return Checked(len(texts), diff, agree)
