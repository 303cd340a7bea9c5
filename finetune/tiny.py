"""A tiny tokenizer and model that ft builds offline: for the quickstart and for tests.

The tokenizer is a byte-level BPE trained in a fraction of a second with `tokenizers` on text this
module generates, wrapped in `PreTrainedTokenizerFast`. It knows the special tokens of every built-in
chat template (so each template renders to single tokens) and carries a ChatML chat template.
The model is a `LlamaForCausalLM` built from the `ft-tiny` catalog entry (or another small spec).
"""

from __future__ import annotations

import random
from pathlib import Path

TEMPLATE_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",  # chatml, qwen
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",  # llama3
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",  # mistral
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",  # gemma
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",  # phi3
]
TINY_VERSION = 2  # bump when the tokenizer corpus or the model construction changes
EOS = "<|endoftext|>"
PAD = "<|pad|>"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Text the BPE is trained on: arithmetic, short English, chat role names."""
    rng = random.Random(seed)
    words = (
        "the model learns to add numbers and answer questions about text data while training on "
        "small examples user assistant system you are a helpful what is how many please"
    ).split()
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}. Reverse {a}{b}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + ".")
    return lines


def build_tokenizer(
    out_dir: str | Path | None = None, vocab_size: int = 512, extra_special: tuple[str, ...] = tuple(TEMPLATE_TOKENS)
):
    """Train the tiny tokenizer; save it to out_dir when given. Returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # digits are single tokens, as in the Qwen and Llama 3 tokenizers: arithmetic stays learnable
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    special = [EOS, PAD, *extra_special]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None)
    fast.chat_template = CHATML
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def build_model(out_dir: str | Path, name: str = "ft-tiny", seed: int = 0, tokenizer=None):
    """Save a randomly initialised tiny Llama (the catalog's `name` entry) and its tokenizer to out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.catalog import lookup

    facts = lookup(name)
    tokenizer = tokenizer or build_tokenizer(vocab_size=facts.vocab_size)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=facts.hidden_size,
        intermediate_size=facts.intermediate_size,
        num_hidden_layers=facts.num_layers,
        num_attention_heads=facts.num_attention_heads,
        num_key_value_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        max_position_embeddings=facts.max_position_embeddings,
        tie_word_embeddings=facts.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return model, tokenizer


def arithmetic_records(n: int, seed: int = 0, max_operand: int = 99) -> list[dict]:
    """Chat records asking for a sum, or for a digit string reversed: tasks where learning is visible (exact match)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            question, answer = f"What is {a} + {b}?", str(a + b)
        else:
            digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
            question, answer = f"Reverse {digits}", digits[::-1]
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return out


def _wrong(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: one digit changed."""
    i = rng.randrange(len(answer))
    digit = rng.choice([d for d in "0123456789" if d != answer[i]])
    return answer[:i] + digit + answer[i + 1 :]


def preference_records(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs on the arithmetic tasks: the right answer chosen, a one-digit-wrong answer rejected."""
    rng = random.Random(seed + 1)
    out = []
    for rec in arithmetic_records(n, seed):
        prompt, answer = rec["messages"][0]["content"], rec["messages"][1]["content"]
        out.append(
            {
                "prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": _wrong(answer, rng)}],
            }
        )
    return out


def answer_records(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs for reward models: the right answer chosen, the right answer to the next question rejected (a
    reward model of this size learns to check an answer against its question, not to spot one wrong digit)."""
    pairs = preference_records(n + 1, seed)
    return [{**pair, "rejected": other["chosen"]} for pair, other in zip(pairs, pairs[1:])]


def unpaired_records(n: int, seed: int = 0) -> list[dict]:
    """Unpaired feedback (KTO) from `n` preference pairs: each chosen answer labelled true, each rejected one false,
    the 2n rows shuffled (so neighbouring rows rarely share a prompt)."""
    out = [
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for pair in preference_records(n, seed)
        for side in ("chosen", "rejected")
    ]
    random.Random(seed + 2).shuffle(out)
    return out


def prompt_records(n: int, seed: int = 0) -> list[dict]:
    """Prompt-only arithmetic tasks with their answer in a column of its own (for GRPO rewards)."""
    return [
        {"prompt": r["messages"][0]["content"], "answer": r["messages"][1]["content"]}
        for r in arithmetic_records(n, seed)
    ]


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def ensure_model(name: str = "ft-tiny", root: str | Path = "~/.cache/ft/models") -> Path:
    """The tiny model's folder in ft's cache, built (deterministically, seed 0) on first use: ft-tiny (alias tiny), or
    ft-tiny-vision (a tiny LLaVA with its processor, build_vlm)."""
    import hashlib
    import os
    import shutil

    from finetune.catalog import lookup

    vision = name.lower() == VISION_MODEL
    name = VISION_MODEL if vision else "ft-tiny"
    # the folder name carries the spec and this module's version, so a changed spec builds a new model
    spec = hashlib.sha256(repr((VLM_VERSION if vision else lookup(name), TINY_VERSION)).encode()).hexdigest()[:12]
    folder = Path(root).expanduser() / f"{name}-{spec}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(f".{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if vision:
        build_vlm(tmp)
    else:
        build_model(tmp, name=name)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


# ---------------------------------------------------------------- a tiny vision-language model and an image task
IMAGE_TOKEN = "<image>"
VISION_MODEL = "ft-tiny-vision"
VLM_VERSION = 1  # bump when build_vlm changes
VLM_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
COLORS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}


def build_vlm(out_dir: str | Path, seed: int = 0, image_size: int = 32, patch: int = 8, grids=None):
    """Save a randomly initialised tiny LLaVA (a 2-layer CLIP vision tower, a projector, a 2-layer Llama) with its
    processor (ft's tiny tokenizer with an image token, a CLIP image processor, a ChatML template with image parts) to
    out_dir: a folder transformers loads with AutoModelForImageTextToText and AutoProcessor. With `grids` (anyres
    grid pinpoints), its LLaVA-NeXT form."""
    import transformers
    from transformers import CLIPVisionConfig, LlamaConfig

    kind = "LlavaNext" if grids else "Llava"
    anyres = {"image_grid_pinpoints": grids} if grids else {}
    tokenizer = build_tokenizer(extra_special=(*TEMPLATE_TOKENS, IMAGE_TOKEN))
    tokenizer.chat_template = VLM_TEMPLATE
    image_processor = transformers.LlavaNextImageProcessorPil if grids else transformers.CLIPImageProcessorPil
    images = image_processor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}, **anyres
    )
    processor = getattr(transformers, f"{kind}Processor")(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=VLM_TEMPLATE,
        patch_size=patch,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )
    config = getattr(transformers, f"{kind}Config")(
        vision_config=vision_config(CLIPVisionConfig, image_size, patch, layers=2, projection_dim=32),
        text_config=text_config(LlamaConfig, tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
        **anyres,
    )
    return save_with_processor(
        getattr(transformers, f"{kind}ForConditionalGeneration"), config, processor, out_dir, seed
    )


def text_config(cls, tokenizer, **extra):
    """The tiny vision-language models' language side: 2 layers of width 64, 4 heads (2 for keys and values)."""
    return cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **extra,
    )


def vision_config(cls, image_size: int, patch: int, layers: int = 1, **extra):
    """The tiny vision-language models' tower: width 32, 2 heads, `layers` layers."""
    return cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch,
        **extra,
    )


def save_with_processor(model_class, config, processor, out_dir, seed: int):
    """The model built from `config` (seeded), saved to out_dir with its processor."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return model, processor


def image_records(n: int, folder: str | Path, seed: int = 0, size: int = 32, noise: bool = True) -> list[dict]:
    """Chat records asking the colour of the square in a generated picture, each with its image (PNG, written into
    `folder`, referenced relative to it): the answer depends on the image alone (text alone is at chance, 1 in 4).
    The background is dark noise, or (`noise` False: small files, for the example the repo ships) one dark colour
    with a few dark stripes."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    names = sorted(COLORS)
    out = []
    for i in range(n):
        color = rng.choice(names)
        draw = np.random.default_rng(seed * 100003 + i)
        if noise:
            pixels = draw.integers(0, 60, (size, size, 3), dtype=np.uint8)
        else:
            pixels = np.broadcast_to(draw.integers(0, 60, 3, dtype=np.uint8), (size, size, 3)).copy()
            for row in draw.integers(0, size, 3):
                pixels[row] = draw.integers(0, 60, 3, dtype=np.uint8)
        side = rng.randint(size // 2, size - 4)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        pixels[y : y + side, x : x + side] = COLORS[color]
        name = f"images/{seed}-{i}.png"
        Image.fromarray(pixels).save(folder / name)
        question = [{"type": "image", "image": name}, {"type": "text", "text": "What colour is the square?"}]
        out.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": color}]})
    return out


def vision_task(out_dir: str | Path, train: int = 240, test: int = 40, noise: bool = True) -> Path:
    """An image task for the tiny vision-language model (ft-tiny-vision): the colour task's images and chat records in
    out_dir (train.jsonl, test.jsonl, disjoint seeds). Returns out_dir."""
    out = Path(out_dir)
    write_jsonl(image_records(train, out, seed=1, noise=noise), out / "train.jsonl")
    write_jsonl(image_records(test, out, seed=2, noise=noise), out / "test.jsonl")
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m finetune.tiny", description="Write ft's offline example data.")
    parser.add_argument("what", choices=["vision"], help="vision: the colour-of-the-square image task")
    parser.add_argument("out", type=Path, help="folder to write (train.jsonl, test.jsonl, images/)")
    parser.add_argument("--train", type=int, default=240, help="training records")
    parser.add_argument("--test", type=int, default=40, help="held-out records")
    parser.add_argument("--plain", action="store_true", help="plain backgrounds (small files) instead of noise")
    args = parser.parse_args(argv)
    out = vision_task(args.out, args.train, args.test, noise=not args.plain)
    print(f"wrote {out}: train.jsonl ({args.train} records), test.jsonl ({args.test}), images/")


if __name__ == "__main__":
    main()
