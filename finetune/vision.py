"""Vision-language models: images in chat records, the model's own processor, and what of the vision side trains.

A canonical chat record with images keeps its messages as text, each image's place marked by `PLACEHOLDER` (the
LLaVA convention), and its images as absolute paths in order (`images`). Records arrive either that way (a top-level
`images` list and `<image>` in the text) or with content parts, the form transformers' processors take
(`{"type": "text", "text": ...}`, `{"type": "image", "image": PATH}`); data/formats.py reads both into the canonical
form, and `check_image` refuses a file that is missing, not an image, truncated or over the pixel limit.

Tokenizing (`tokenize_images`): the conversation is rendered with the processor's chat template (content parts, so
that the template writes the family's own image marker), tokenized as text with ft's loss mask (data/masking.py),
then put through the processor, which expands each marker into the image's tokens by the family's resolution rules.
The processor's token ids are the text's with tokens inserted; each text token keeps its label and every inserted
token (the image's) is never trained. The pixels are computed again when a batch is made (`image_inputs`), from the
same files, so the prepared data holds token ids and paths, not pixels.

Most families put an image's tokens in the sequence, and a batch's images go to the tower as one list. Llama 3.2
Vision (`cross_attention`) keeps one `<|image|>` token per image in the text and reads the image's tiles through
cross-attention layers: its pixels are grouped per sequence, and each token sees the tiles of the images before it
(transformers' own cross_attention_mask, built for the batch as its processor builds it).
"""

from __future__ import annotations

from pathlib import Path

PLACEHOLDER = "<image>"
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's decompression-bomb limit (Image.MAX_IMAGE_PIXELS)
# where transformers' vision-language models keep their vision tower and the projector into the language model
TOWERS = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder")
PROJECTORS = ("multi_modal_projector", "connector", "mm_projector", "merger", "embed_vision", "projector")
# inputs a processor's image side returns, which the model's forward takes
PIXEL_INPUTS = (
    "pixel_values",
    "image_sizes",
    "image_grid_thw",
    "pixel_attention_mask",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "image_position_ids",
)
# what marks each token's modality for the model (Qwen-VL's 3-D RoPE, Gemma 3's bidirectional image attention)
TOKEN_TYPE_INPUTS = ("mm_token_type_ids", "token_type_ids")
# the image tiles each token attends to, where the model reads images through cross-attention (Llama 3.2 Vision)
CROSS_ATTENTION_INPUTS = ("cross_attention_mask",)
# families whose image tokens take ordinary 1-D positions in a causal language model, each image encoded on its own:
# their samples can share a packed row (positions restarting per sample, attention kept inside each)
PACKABLE = ("llava", "llava_next", "llava_onevision", "mistral3", "idefics2", "idefics3", "smolvlm")


class ImageError(ValueError):
    """An image a record names that cannot be used; the message says which and why (the caller adds file:line)."""


# ---------------------------------------------------------------- files
def resolve(ref: str, origin_file: str | None) -> Path:
    """An image reference as a path: absolute, or relative to the data file the record came from; an http(s) URL or
    a data: URI is downloaded (decoded) once into ft's image cache (`fetch`)."""
    if not isinstance(ref, str) or not ref.strip():
        raise ImageError(f"an image reference must be a path, got {ref!r}")
    if ref.startswith(("http://", "https://", "data:")):
        return fetch(ref)
    path = Path(ref).expanduser()
    if not path.is_absolute() and origin_file:
        path = Path(origin_file).parent / path
    return path


IMAGE_CACHE = "~/.cache/ft/images"  # FT_IMAGE_CACHE names another folder
MAX_DOWNLOAD = 64 * 2**20  # bytes of one image from a URL


def fetch(ref: str) -> Path:
    """The file of an image given by URL (http, https) or data: URI, in ft's image cache: named by the reference's
    hash, downloaded (at most MAX_DOWNLOAD bytes) or decoded once and reused after, so that a run, its resume and
    `ft generate` read the same bytes; written whole or not at all. ImageError (the URL shown without its query,
    which may hold a token) when it cannot be had."""
    import base64
    import binascii
    import hashlib
    import os
    import urllib.error
    import urllib.request

    folder = Path(os.environ.get("FT_IMAGE_CACHE") or IMAGE_CACHE).expanduser()
    path = folder / hashlib.sha256(ref.encode()).hexdigest()[:40]
    if path.is_file():
        return path
    shown = shown_url(ref)
    if ref.startswith("data:"):
        head, _, body = ref.partition(",")
        try:
            data = base64.b64decode(body, validate=True) if head.endswith(";base64") else body.encode()
        except (binascii.Error, ValueError):
            raise ImageError(f"image {shown} is a data: URI whose base64 content cannot be decoded") from None
    else:
        try:
            with urllib.request.urlopen(urllib.request.Request(ref, headers={"User-Agent": "ft"}), timeout=30) as r:
                data = r.read(MAX_DOWNLOAD + 1)
        except urllib.error.HTTPError as e:
            raise ImageError(f"image {shown} could not be downloaded: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
            why = getattr(e, "reason", None) or e
            raise ImageError(
                f"image {shown} could not be downloaded ({why}); download it next to the data file and give its path "
                "where there is no network"
            ) from None
        if len(data) > MAX_DOWNLOAD:
            raise ImageError(f"image {shown} is larger than {MAX_DOWNLOAD // 2**20} MiB; ft does not download it")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def shown_url(ref: str) -> str:
    """A URL for messages: scheme, host and path (a query may hold a signature or a token); a data: URI's type."""
    if ref.startswith("data:"):
        return repr(ref.partition(",")[0] + ",...")
    from urllib.parse import urlsplit

    parts = urlsplit(ref)
    return repr(f"{parts.scheme}://{parts.hostname or ''}{parts.path}" + ("?..." if parts.query else ""))


def check_image(path: Path) -> None:
    """Open and fully decode the image at `path`. ImageError when it is missing,
    unreadable, not an image, truncated, or has more than DEFAULT_MAX_PIXELS pixels (a decompression bomb)."""
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise ImageError(f"image {str(path)!r} does not exist" if not path.exists() else f"{str(path)!r} is not a file")
    try:
        with Image.open(path) as img:
            width, height = img.size
            if width * height > DEFAULT_MAX_PIXELS:
                raise ImageError(
                    f"image {str(path)!r} has {width}x{height} = {width * height} pixels, over the limit of "
                    f"{DEFAULT_MAX_PIXELS} (PIL's decompression-bomb limit): a decompression bomb, or an image to "
                    "downscale before training"
                )
            img.load()  # decodes every pixel: a truncated file fails here
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"image {str(path)!r} is a decompression bomb: {e}") from None
    except UnidentifiedImageError:
        raise ImageError(f"{str(path)!r} is not an image PIL can read (PNG, JPEG, WebP, GIF, BMP, TIFF...)") from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated data, broken headers, unreadable file
        raise ImageError(f"image {str(path)!r} cannot be decoded: {str(e) or type(e).__name__}") from None


def load_images(paths: list[str]) -> list:
    """The images at `paths`, decoded as RGB (a processor's input)."""
    from PIL import Image

    out = []
    for p in paths:
        with Image.open(p) as img:
            out.append(img.convert("RGB"))
    return out


# ---------------------------------------------------------------- messages
def to_parts(messages: list[dict]) -> list[dict]:
    """Canonical messages (text with `PLACEHOLDER`) as content parts, the form processors' chat templates render."""
    out = []
    for m in messages:
        pieces = m["content"].split(PLACEHOLDER)
        parts = []
        for k, text in enumerate(pieces):
            if k:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": m["role"], "content": parts})
    return out


def for_template(messages: list[dict], processor, jinja: str) -> list[dict]:
    """The messages as `jinja` renders them: content parts where it is the processor's (or its tokenizer's) own chat
    template, which writes the family's image marker itself; text where it is another (a built-in, a file), each image
    marker replaced by the one the processor expands (`image_marker`)."""
    own = {getattr(processor, "chat_template", None), getattr(processor.tokenizer, "chat_template", None)} - {None}
    if jinja in own:
        return to_parts(messages)
    marker = image_marker(processor)
    return [{**m, "content": m["content"].replace(PLACEHOLDER, marker)} for m in messages]


def image_marker(processor) -> str:
    """The text that stands for one image before the processor expands it: what its own chat template writes for an
    image part (Gemma 3's <start_of_image>, Qwen-VL's <|vision_start|><|image_pad|><|vision_end|>), else its
    image_token."""
    from finetune.templates import TemplateError, render

    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if template:
        parts = [{"type": "text", "text": "\x00"}, {"type": "image"}, {"type": "text", "text": "\x01"}]
        try:
            text = render([{"role": "user", "content": parts}], processor.tokenizer, template)
        except TemplateError:
            text = ""
        if "\x00" in text and "\x01" in text:
            marker = text.split("\x00", 1)[1].split("\x01", 1)[0]
            if marker.strip():
                return marker
    return getattr(processor, "image_token", None) or PLACEHOLDER


# ---------------------------------------------------------------- models and processors
def load_processor(model_section, path: str, image=None):
    """The model's own processor (chat template, image processor, image tokens) from `path`, its image side sized by
    `image` (data.image, see `sized`)."""
    from transformers import AutoProcessor

    from finetune.errors import FtError

    try:
        processor = AutoProcessor.from_pretrained(
            path, revision=model_section.revision, trust_remote_code=model_section.trust_remote_code
        )
    except (OSError, ValueError, AttributeError, ImportError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FtError(
            f"model.name: {model_section.name!r} is a vision-language model, but its processor cannot be loaded "
            f"({first}); ft needs the model's processor files (preprocessor_config.json, processor_config.json) "
            "beside its weights"
        ) from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise FtError(
            f"model.name: the processor of {model_section.name!r} ({type(processor).__name__}) has no image processor "
            "and tokenizer; ft trains vision-language models through processors that have both"
        )
    if image is not None:
        processor.image_processor = sized(processor.image_processor, image)
    return processor


def settings(image_processor) -> list[str]:
    """The names of the settings an image processor takes (transformers' valid_kwargs of its class)."""
    kinds = getattr(type(image_processor), "valid_kwargs", None)
    return sorted(getattr(kinds, "__annotations__", {}))


def sized(image_processor, image):
    """The image processor with data.image's settings (min_pixels/max_pixels, and `processor`'s by the processor's
    own names), built again from its saved settings so that each takes effect as the processor's own constructor reads
    it; FtError naming the key when the processor does not take a setting."""
    from finetune.errors import FtError

    wanted = {
        **{k: v for k, v in (("min_pixels", image.min_pixels), ("max_pixels", image.max_pixels)) if v is not None},
        **image.processor,
    }
    if not wanted:
        return image_processor
    known = settings(image_processor)
    name = type(image_processor).__name__
    for key in wanted:
        if key not in known:
            where = f"data.image.{key}" if key in ("min_pixels", "max_pixels") else f"data.image.processor.{key}"
            fix = (
                "remove it; this processor sizes images by its own rules"
                + (f" (size: {_shown(image_processor.size)})" if getattr(image_processor, "size", None) else "")
                if key in ("min_pixels", "max_pixels")
                else f"use one of the settings it takes: {', '.join(known)}"
            )
            raise FtError(f"{where}: {name} does not take {key!r}.\n    fix: {fix}")
    saved = image_processor.to_dict()
    for key in ("image_processor_type", "processor_class", "_processor_class"):
        saved.pop(key, None)
    if "min_pixels" in wanted or "max_pixels" in wanted:
        saved.pop("size", None)  # resized by pixel count: the constructor sets its size from the two limits
        for key in ("min_pixels", "max_pixels"):
            wanted.setdefault(key, getattr(image_processor, key, None) or _size_limit(image_processor, key))
    try:
        return type(image_processor)(**{**saved, **wanted})
    except (TypeError, ValueError) as e:
        raise FtError(f"data.image: {name} refused the settings {wanted}: {e}") from None


def _shown(size) -> str:
    items = size.items() if isinstance(size, dict) else vars(size).items()
    return ", ".join(f"{k}={v}" for k, v in items if v is not None)


def _size_limit(image_processor, key: str):
    """A pixel-count processor's current limit (its size's shortest_edge/longest_edge hold min/max pixels)."""
    size = getattr(image_processor, "size", None) or {}
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    return get("shortest_edge" if key == "min_pixels" else "longest_edge")


def tokenize_images(messages: list[dict], images: list[str], processor, jinja: str, train_on: str):
    """input_ids and labels of a conversation with images: the text's tokens and loss mask (data/masking.py), with
    each image marker expanded by the processor into the image's tokens, none of which is trained."""
    from finetune.data.masking import tokenize_conversation

    parts = for_template(messages, processor, jinja)
    ids, labels = tokenize_conversation(parts, processor.tokenizer, jinja, train_on)
    return _labelled(parts, ids, labels, images, processor, jinja)


def tokenize_pair_side(prompt: list[dict], answer: list[dict], images: list[str], processor, jinja: str):
    """input_ids and labels of a preference pair's prompt (with its images) and one of its answers, only the answer's
    assistant turns trained (data/masking.py tokenize_continuation), each image marker expanded by the processor."""
    from finetune.data.masking import tokenize_continuation

    prompt_parts, answer_parts = for_template(prompt, processor, jinja), for_template(answer, processor, jinja)
    ids, labels = tokenize_continuation(prompt_parts, answer_parts, processor.tokenizer, jinja)
    return _labelled(prompt_parts + answer_parts, ids, labels, images, processor, jinja)


def _labelled(parts, ids: list[int], labels: list[int], images: list[str], processor, jinja: str):
    """The conversation `parts` (tokenized as text into ids and labels) with its images expanded: each text token keeps
    its label, each inserted one is never trained."""
    from finetune.data.masking import IGNORE
    from finetune.templates import render

    full, text_positions = _expand(render(parts, processor.tokenizer, jinja), ids, images, processor)
    out = [IGNORE] * len(full)
    for k, position in enumerate(text_positions):
        out[position] = labels[k]
    return full, out


def tokenize_prompt(messages: list[dict], images: list[str], processor, jinja: str) -> list[int]:
    """Token ids of a prompt with images, rendered with the generation prompt (what `ft generate` continues): the
    text's tokens as for a text prompt, each image marker expanded by the processor."""
    from finetune.data.masking import tokenize_prompt as text_prompt
    from finetune.templates import render

    parts = for_template(messages, processor, jinja)
    ids = text_prompt(parts, processor.tokenizer, jinja)
    full, _ = _expand(render(parts, processor.tokenizer, jinja, add_generation_prompt=True), ids, images, processor)
    return full


def _expand(text: str, ids: list[int], images: list[str], processor) -> tuple[list[int], list[int]]:
    """(the processor's token ids of `text` with its images, the position of each of `ids` in them): the processor
    only inserts the images' tokens between the text's."""
    from finetune.errors import DataError

    expanded = processor(text=[text], images=load_images(images) if images else None, add_special_tokens=False)
    full = [int(t) for t in expanded["input_ids"][0]]
    positions, i = [], 0
    for position, token in enumerate(full):
        if i < len(ids) and token == ids[i]:
            positions.append(position)
            i += 1
    if i != len(ids):
        raise DataError(
            f"{type(processor).__name__} changed the conversation's text tokens while expanding its images (matched "
            f"{i} of {len(ids)}), so ft cannot place the loss mask on them; report the model family"
        )
    return full, positions


def _in_dtype(got, dtype) -> dict:
    """The model's pixel inputs among what an image processor returned (pixel_values and the family's sizes/grids),
    floating tensors in `dtype`."""
    import torch

    return {
        key: value.to(dtype) if dtype is not None and value.is_floating_point() else value
        for key, value in got.items()
        if key in PIXEL_INPUTS and isinstance(value, torch.Tensor)
    }


def cross_attention(processor) -> bool:
    """The model reads images through cross-attention layers (Llama 3.2 Vision): its processor returns a
    cross_attention_mask beside pixels grouped per sequence."""
    return CROSS_ATTENTION_INPUTS[0] in getattr(processor, "model_input_names", ())


def image_inputs(processor, input_ids, images: list[list[str]], dtype=None) -> dict:
    """What a batch of token rows (`input_ids`, a 2-D tensor) adds for the model's images: `images[i]` are row i's
    image files, in the order of its image markers. Pixel inputs in `dtype`, each token's modality where the model
    reads it (token_types) and, for a cross-attention family, the mask of the tiles each token attends to."""
    if cross_attention(processor):
        return _cross_attention_inputs(processor, input_ids, images, dtype) if any(images) else {}
    paths = [p for row in images for p in row]
    out = _in_dtype(processor.image_processor(images=load_images(paths), return_tensors="pt"), dtype) if paths else {}
    return {**out, **token_types(processor, input_ids)}


def _cross_attention_inputs(processor, input_ids, images: list[list[str]], dtype=None) -> dict:
    """Llama 3.2 Vision's inputs: the image processor's pixels, aspect ratios and tile counts of each row's images (a
    row without images gets none), and the dense cross_attention_mask (batch, tokens, images, tiles) that
    transformers' MllamaProcessor builds from the image tokens' places: each image is seen by the tokens from its
    own image token on (to the next image's, or to the end for the last image or a run of images)."""
    import torch
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    got = processor.image_processor(images=[load_images(row) for row in images], return_tensors="pt")
    image_id = getattr(processor, "image_token_id", None)
    if image_id is None:
        image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    spans = [get_cross_attention_token_mask(row, image_id) for row in input_ids.tolist()]
    mask = convert_sparse_cross_attention_mask_to_dense(
        spans, got["num_tiles"], processor.image_processor.max_image_tiles, input_ids.shape[1]
    )
    return {CROSS_ATTENTION_INPUTS[0]: torch.from_numpy(mask).to(input_ids.device), **_in_dtype(got, dtype)}


class Pixels:
    """What a method adds to a micro-batch of a vision-language model's rows: the inputs of their images
    (`image_inputs`), pixels in the dtype the tower is loaded in."""

    def __init__(self, processor, dtype=None):
        self.processor, self.dtype = processor, dtype

    def add(self, batch: dict, images: list[list[str]], packed: bool = False) -> dict:
        """`batch` (collated rows; `images[i]` the image files of row i) made a vision-language model's: the images'
        inputs (`image_inputs`) and, for right-padded rows, no position ids: the model places the tokens itself
        (Qwen-VL's 3-D positions of image tokens; 0, 1, ... along each row for the others, as collate's). `packed`
        rows keep theirs, restarting at each sample (families with 1-D positions only: PACKABLE)."""
        if any(isinstance(row, str) for row in images):
            raise TypeError("Pixels.add takes one list of image files per row of the batch")
        batch.update(image_inputs(self.processor, batch["input_ids"], [list(row or ()) for row in images], self.dtype))
        if not packed:
            batch.pop("position_ids", None)
        return batch


def token_types(processor, input_ids) -> dict:
    """The modality of each token (0 text, 1 image) under the name the model's forward reads it by, from the processor's
    own create_mm_token_type_ids ({} where the model reads none)."""
    import torch

    names = [n for n in TOKEN_TYPE_INPUTS if n in getattr(processor, "model_input_names", ())]
    if not names or not hasattr(processor, "create_mm_token_type_ids"):
        return {}
    types = processor.create_mm_token_type_ids(input_ids.tolist())
    return {names[0]: torch.tensor(types, dtype=torch.long, device=input_ids.device)}


def mixed_rows_problem(plan, rows) -> str | None:
    """Why the prepared `rows` cannot train under `plan`, or None: a vision-language model on several ranks of FSDP or
    DeepSpeed, with rows that have images and rows that have none. A micro-batch without images skips the vision
    side, so the ranks would disagree on the collectives of its sharded parameters or of its gradients (the run dies
    at its first such step); DDP finds the unused parameters instead."""
    import pyarrow.compute as pc

    if not getattr(plan, "vision", False) or plan.world_size < 2 or plan.backend not in ("fsdp", "deepspeed"):
        return None
    if rows is None or "images" not in rows.column_names:
        return None
    counts = pc.list_value_length(rows.table.column("images")).fill_null(0)  # data/rows.py: an Arrow table
    without = int(pc.sum(pc.equal(counts, 0)).as_py() or 0)
    if without == 0 or without == len(rows):
        return None
    return (
        f"{without} of the {len(rows)} prepared rows have no image; on {plan.world_size} ranks of {plan.backend} a "
        "micro-batch without images skips the vision side, and the ranks' collectives would not match.\n    fix: "
        "set distributed.backend: ddp (it finds the parameters a micro-batch leaves unused), or give every record "
        "an image (or none)"
    )


def parts_of(model) -> tuple[list[str], list[str]]:
    """The module names of the vision tower(s) and of the projector(s) into the language model in a transformers
    vision-language model (a projector may sit inside its tower: Qwen2-VL's visual.merger)."""
    towers, projectors = [], []
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in PROJECTORS and not any(name.startswith(p + ".") for p in projectors):
            projectors.append(name)
        elif last in TOWERS and not any(name.startswith(t + ".") for t in towers):
            towers.append(name)
    return towers, projectors


def unquantized_patterns() -> list[str]:
    """bitsandbytes' llm_int8_skip_modules for the vision side, wherever it sits. transformers 5.25 matches each pattern
    as a regex from the start of a module's full name up to a name boundary, or as a suffix
    (quantizers/quantizers_utils.py should_convert_module): a bare "vision_tower" would miss
    "model.vision_tower.encoder.layers.0.q_proj", so each name may follow any prefix."""
    return [rf"(?:.*\.)?{name}" for name in (*TOWERS, *PROJECTORS)]


def vision_names(model) -> list[str]:
    """Every module name on the vision side (tower and projector): LoRA leaves them alone."""
    towers, projectors = parts_of(model)
    return towers + [p for p in projectors if not any(p.startswith(t + ".") for t in towers)]


def freeze(model, train_vision: str) -> None:
    """Set requires_grad on the vision side: the tower trains only with `all`, the projector with `projector` or
    `all`."""
    towers, projectors = parts_of(model)
    for name in towers:
        model.get_submodule(name).requires_grad_(train_vision == "all")
    for name in projectors:
        model.get_submodule(name).requires_grad_(train_vision in ("projector", "all"))
