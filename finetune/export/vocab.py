"""A tokenizer as llama.cpp reads it from a GGUF file: its model, pre-tokenizer, tokens, merges and special tokens.

Two kinds are written. A byte-level BPE (tokenizer.json with a BPE model, a ByteLevel decoder and no byte fallback:
GPT-2, Llama 3, Qwen, ft's tiny tokenizer) becomes llama.cpp's "gpt2" model: the tokens as the tokenizer spells
them, its merges, and the name of the pre-tokenizer llama.cpp splits text with, found by matching tokenizer.json's
pre-tokenizer against gguf_families.yaml (a pre-tokenizer llama.cpp does not know is refused: it would split text
otherwise). A sentencepiece BPE (Llama 2, Mistral, Gemma: byte fallback, U+2581 for spaces) becomes its "llama" model,
each piece scored by its merge order. The special tokens and merges come from the gguf package's SpecialVocab; what
the tokenizer adds around a text (BOS, EOS) is measured on the tokenizer itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError
from finetune.export.families import pre_tokenizers

NORMALIZERS = (None, "NFC")  # what llama.cpp's BPE applies to text as transformers does (Qwen's tokenizers use NFC)


@dataclass(frozen=True)
class VocabInfo:
    """What was written: llama.cpp's tokenizer model and pre-tokenizer, the token count, padding rows."""

    model: str  # gpt2 | llama
    pre: str
    tokens: int  # tokens of the tokenizer
    padded: int  # embedding rows beyond them, written as unused tokens


def _steps(pre: dict | None) -> list[str]:
    """A tokenizer.json pre-tokenizer as the steps gguf_families.yaml lists."""
    if pre is None:
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        return [step for inner in pre.get("pretokenizers", []) for step in _steps(inner)]
    if kind == "Digits":
        return ["digits" if pre.get("individual_digits") else "digits:grouped"]
    if kind == "ByteLevel":
        if pre.get("add_prefix_space"):
            return ["bytelevel:prefix-space"]
        return ["bytelevel" if pre.get("use_regex", True) else "bytes"]
    if kind == "Split" and pre.get("behavior") == "Isolated" and not pre.get("invert"):
        pattern = pre.get("pattern") or {}
        if "Regex" in pattern:
            return [f"split:{pattern['Regex']}"]
    return [f"{kind}:{json.dumps(pre, sort_keys=True)[:80]}"]


def pre_tokenizer_name(tokenizer_json: dict, where: Path) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE; FtError when llama.cpp has none like it."""
    normalizer = tokenizer_json.get("normalizer")
    if (normalizer or {}).get("type") not in NORMALIZERS:
        raise FtError(
            f"{where}: the tokenizer normalizes text ({normalizer.get('type')}), which llama.cpp's byte-level BPE "
            "does not; the GGUF file would tokenize text otherwise.\n    fix: export a model whose tokenizer has no "
            "normalizer (or NFC), or convert it with llama.cpp's own converter"
        )
    steps = tuple(_steps(tokenizer_json.get("pre_tokenizer")))
    for known in pre_tokenizers():
        if known.steps == steps:
            return known.name
    raise FtError(
        f"{where}: llama.cpp knows no pre-tokenizer that splits text as this tokenizer's does ({' -> '.join(steps)}); "
        "the GGUF file would tokenize text otherwise.\n    fix: export a model whose tokenizer splits text as GPT-2, "
        "Llama 3 or Qwen 2 do (finetune/export/gguf_families.yaml lists them), or convert it with llama.cpp's own "
        "converter"
    )


def _token_types(tokenizer, n: int) -> list[int]:
    import gguf

    types = [int(gguf.TokenType.NORMAL)] * n
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if token_id < n:
            types[token_id] = int(gguf.TokenType.CONTROL if added.special else gguf.TokenType.USER_DEFINED)
    for token_id in tokenizer.all_special_ids:
        if token_id < n:
            types[token_id] = int(gguf.TokenType.CONTROL)
    return types


def _adds(tokenizer) -> tuple[bool, bool]:
    """Whether the tokenizer puts its BOS before, and its EOS after, a text it encodes."""
    ids = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return bool(ids) and bos is not None and ids[0] == bos, bool(ids) and eos is not None and ids[-1] == eos


def _byte_level(writer, tokenizer, rows: int, pre: str) -> None:
    import gguf

    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    types = _token_types(tokenizer, n)
    tokens += [f"[PAD{i}]" for i in range(n, rows)]
    types += [int(gguf.TokenType.UNUSED)] * (rows - n)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _sentencepiece(writer, tokenizer, rows: int) -> None:
    """A sentencepiece BPE as transformers keeps it (tokenizer.json: pieces with U+2581 for spaces, <0xNN> byte
    pieces) as llama.cpp's "llama" model. sentencepiece numbers a BPE's pieces in the order it merged them and llama.cpp
    merges the pair whose result scores highest, so a piece scores minus its id."""
    import gguf

    n = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    types = _token_types(tokenizer, n)
    for i, token in enumerate(tokens):
        if types[i] == int(gguf.TokenType.NORMAL) and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            types[i] = int(gguf.TokenType.BYTE)
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id < n:
        types[tokenizer.unk_token_id] = int(gguf.TokenType.UNKNOWN)
    scores = [-float(i) if kind == int(gguf.TokenType.NORMAL) else 0.0 for i, kind in enumerate(types)]
    tokens += [f"[PAD{i}]" for i in range(n, rows)]
    types += [int(gguf.TokenType.UNUSED)] * (rows - n)
    scores += [-float(rows)] * (rows - n)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    first = tokenizer.convert_ids_to_tokens(tokenizer("a", add_special_tokens=False)["input_ids"][:1])
    writer.add_add_space_prefix(bool(first) and first[0].startswith("\u2581"))


def write_vocab(writer, tokenizer, folder: Path, rows: int, chat_template: str, eot: str | None) -> VocabInfo:
    """Write the tokenizer saved in `folder` (and loaded as `tokenizer`) into `writer` for a model with `rows`
    embedding rows, with `chat_template` and the template's end-of-turn token `eot`."""
    import gguf

    if len(tokenizer) > rows:
        raise FtError(
            f"the tokenizer has {len(tokenizer)} tokens but the model only {rows} embedding rows.\n    fix: export "
            "the tokenizer the model was trained with (the run's final/ folder holds it)"
        )
    spec = json.loads((folder / "tokenizer.json").read_text()) if (folder / "tokenizer.json").is_file() else {}
    bpe = spec.get("model", {})
    if bpe.get("type") == "BPE" and bpe.get("byte_fallback"):
        model, pre, n = "llama", "default", len(tokenizer)
        _sentencepiece(writer, tokenizer, rows)
    elif (
        bpe.get("type") == "BPE"
        and not bpe.get("byte_fallback")
        and (spec.get("decoder") or {}).get("type") == ("ByteLevel")
    ):
        model, pre, n = "gpt2", pre_tokenizer_name(spec, folder / "tokenizer.json"), len(tokenizer)
        _byte_level(writer, tokenizer, rows, pre)
    else:
        raise FtError(
            f"{folder}: ft writes byte-level BPE tokenizers and sentencepiece BPE ones (byte fallback) to GGUF; this "
            f"one is a {bpe.get('type') or 'tokenizer without tokenizer.json'}.\n    fix: convert it with llama.cpp's "
            "own converter"
        )
    special = gguf.SpecialVocab(folder, load_merges=model == "gpt2", n_vocab=rows)
    special.chat_template = None  # the job's template is written below, not the tokenizer's own
    special.add_special_token = {}  # measured on the tokenizer instead
    special.add_to_gguf(writer, quiet=True)
    add_bos, add_eos = _adds(tokenizer)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if eot is not None and eot in tokenizer.get_vocab():
        writer.add_eot_token_id(tokenizer.convert_tokens_to_ids(eot))
    if chat_template:
        writer.add_chat_template(chat_template)
    return VocabInfo(model, pre, n, rows - n)
