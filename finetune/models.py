"""Loading tokenizers (and, with the training issue, models) per the config and the Plan."""

from __future__ import annotations

from pathlib import Path

from finetune.config.schema import ModelSection
from finetune.errors import FtError

BUILT_IN = ("ft-tiny", "tiny")


def load_tokenizer(model: ModelSection):
    """The tokenizer named by model.tokenizer, else the model's own; ft-tiny's is built offline."""
    name = model.tokenizer or model.name
    key = "model.tokenizer" if model.tokenizer else "model.name"
    if name.lower() in BUILT_IN and not Path(name).exists():
        from finetune.tiny import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, revision=model.revision, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FtError(f"{key}: cannot load a tokenizer from {name!r}: {first}. Use a local folder with tokenizer files, a hub id (online), or ft-tiny") from None


def add_special_tokens(tokenizer, tokens: list[str]) -> list[str]:
    """Add the tokens that are not yet single tokens; return those added (the model's embeddings must grow)."""
    vocab = tokenizer.get_vocab()
    new = [t for t in dict.fromkeys(tokens) if t not in vocab]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    return new
