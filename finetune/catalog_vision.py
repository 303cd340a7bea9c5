"""A vision-language model's vision tower and its images' sizes, as the planner needs them.

Two numbers per image: the **patches** the tower runs over (its sequence: activations and compute) and the **image
tokens** the language model sees after the projector merges or pools them (they sit inside data.seq_len). Both follow
from the family's resolution rules (`image_geometry`):

  fixed resolution   LLaVA (CLIP, SigLIP), Gemma 3, Mistral 3...: the tower's own image_size (its position table is
                     that size, so the processor resizes to it): (image_size / patch)² patches, +1 class position for a
                     CLIP tower; the language model sees those (LLaVA's "default" feature strategy drops the class
                     one), or the family's fixed count (Gemma 3's mm_tokens_per_image, pooled)
  tiles              Idefics3 / SmolVLM: an image resized to at most `longest_edge` a side is cut into tiles of
                     `tile_edge`, plus one global view: up to ceil(longest_edge / tile_edge)² + 1 tiles, each
                     (image_size / patch)² patches, pixel-shuffled by scale_factor² into image_seq_len tokens
  dynamic            Qwen2-VL, Qwen2.5-VL (and any tower with spatial_merge_size and temporal_patch_size): the
                     processor's smart_resize keeps at most max_pixels in multiples of (patch × merge) a side, so up
                     to max_pixels / (patch × merge)² tokens, merge² patches each
  anyres             LLaVA-NeXT, LLaVA-OneVision (image_grid_pinpoints): the image is resized to the grid pinpoint
                     that fits it best and cut into tiles of image_size, plus a base view: up to the base's tokens,
                     each tile's, and one newline token per row of tile features, at the pinpoint whose shape the
                     image has; OneVision (vision_aspect_ratio anyres_max_N) pools the tile features down to about
                     N tiles' worth
  cross-attention    Llama 3.2 Vision (a tower with max_num_tiles): an image is cut into up to max_image_tiles tiles
                     of image_size, each (image_size / patch)² patches and a class position, padded to a multiple of
                     8; the text holds one <|image|> token per image and reads the tiles through cross-attention layers

Where the processor's resolution is configurable (data.image max_pixels, `size`'s longest_edge), the plan takes the
configured maximum, the worst case it must fit; else the model folder's preprocessor_config.json; else the family's
processor defaults, as transformers' image processor classes declare them (PROCESSOR_DEFAULTS, each with its class;
tests/test_vision_plan.py checks them against the installed transformers).

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from finetune.catalog_data import first

# The family's processor defaults where a model folder has no preprocessor_config.json (a catalog or hub model):
# transformers 5.25's image processor class attributes (tests/test_vision_plan.py checks the installed ones).
PROCESSOR_DEFAULTS: dict[str, dict[str, int]] = {
    # Qwen2VLImageProcessor(Pil): size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, patch_size 14,
    # merge_size 2; Qwen2.5-VL's processor is the same class
    "qwen2_vl": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
    "qwen2_5_vl": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
    # Idefics3ImageProcessor(Pil) and SmolVLMImageProcessor(Pil): size = {"longest_edge": 4 * 364},
    # max_image_size = {"longest_edge": 364}, do_image_splitting = True
    "idefics3": {"longest_edge": 4 * 364, "tile_edge": 364, "splitting": 1},
    "smolvlm": {"longest_edge": 4 * 364, "tile_edge": 364, "splitting": 1},
}
TILED = ("idefics3", "smolvlm")
GATED_MLP = ("qwen2_5_vl",)  # towers whose MLP is gate/up/down (the others: fc1/fc2)
CLS_TOWERS = ("clip_vision_model", "mllama_vision_model")  # towers that add a class position to each image
COMPOSITE_ACTIVATIONS = ("quick_gelu",)  # transformers' activations built of several ops (activations.py)


@dataclass(frozen=True)
class VisionTower:
    """A vision tower's shape, and the processor's resolution settings that size its images."""

    family: str  # the vision-language model's model_type (llava, gemma3, idefics3, qwen2_vl...)
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_size: int = 0  # the tower's fixed input side; 0: dynamic resolution
    gated_mlp: bool = False
    # its MLP's activation is composed of several ops (transformers' quick_gelu: x * sigmoid(1.702 x)), which save a
    # third I-wide tensor for backward (CLIP, Qwen2-VL); a fused GELU saves only its input
    composite_activation: bool = False
    cls_token: bool = False  # one more position per image (CLIP)
    keep_cls: bool = False  # the language model sees it too (LLaVA's vision_feature_select_strategy "full")
    merge: int = 1  # patches merged per side into one token (Qwen: spatial_merge_size; Idefics3: scale_factor)
    temporal_patch: int = 1  # frames a patch spans (Qwen-VL: an image is repeated to fill them)
    tokens_per_image: int = 0  # a fixed count the projector pools each image to (Gemma 3); 0: from the patches
    tiles: int = 0  # a tiled cross-attention tower's most tiles per image (Llama 3.2 Vision: max_num_tiles)
    grid_pinpoints: tuple[tuple[int, int], ...] = ()  # anyres: the (height, width) grids an image may be resized to
    anyres_max: int = 0  # OneVision's vision_aspect_ratio anyres_max_N: tile features pooled to about N tiles
    cross_attention_layers: int = 0  # the language model's layers that attend to the image tiles
    # the processor's resolution (preprocessor_config.json, else PROCESSOR_DEFAULTS); 0 where it does not apply
    min_pixels: int = 0
    max_pixels: int = 0
    max_tiles: int = 0  # the processor's max_image_tiles (Llama 3.2 Vision)
    longest_edge: int = 0
    tile_edge: int = 0
    splitting: bool = False
    processor_source: str = ""  # where those come from

    @property
    def dynamic(self) -> bool:
        return self.image_size == 0

    @property
    def mlp_saved(self) -> int:
        """I-wide tensors one MLP saves for backward per position: gated 4 (gate, up, activation, product), a composite
        activation 3 (fc1's output, the sigmoid, fc2's input), else 2 (fc1's output, fc2's input)."""
        return 4 if self.gated_mlp else 3 if self.composite_activation else 2

    @property
    def params(self) -> int:
        """The encoder layers' parameters (attention 4h², MLP 2 or 3 h·I): what a patch is computed with."""
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * (4 * h * h + (3 if self.gated_mlp else 2) * h * i)


def vision_tower(cfg: dict) -> VisionTower | None:
    """The vision tower of a config.json dict (or a transformers config's `to_dict()`); None without a vision_config."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict):
        return None
    h = int(first(v, ("embed_dim", "hidden_size", "width")) or 0)  # Qwen2-VL: embed_dim (hidden_size: its output)
    if h <= 0:
        return None
    family = str(cfg.get("model_type") or "")
    dynamic = v.get("spatial_merge_size") is not None and v.get("temporal_patch_size") is not None
    patch = int(v.get("patch_size") or 14)
    heads = int(first(v, ("num_attention_heads", "attention_heads", "num_heads", "heads")) or max(1, h // 64))
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    cross = len(text.get("cross_attention_layers") or ())
    aspect = str(cfg.get("vision_aspect_ratio") or "")
    tower = VisionTower(
        family=family,
        hidden_size=h,
        num_layers=int(first(v, ("num_hidden_layers", "depth", "layers", "num_layers")) or 0)
        + int(v.get("num_global_layers") or 0),
        num_heads=heads,
        intermediate_size=int(v.get("intermediate_size") or (v.get("mlp_ratio") or 4) * h),
        patch_size=patch,
        image_size=0 if dynamic else int(v.get("image_size") or 224),
        gated_mlp=family in GATED_MLP,
        composite_activation=str(v.get("hidden_act") or "") in COMPOSITE_ACTIVATIONS,
        cls_token=str(v.get("model_type") or "") in CLS_TOWERS,
        keep_cls=cfg.get("vision_feature_select_strategy") == "full",
        merge=int((v.get("spatial_merge_size") if dynamic else cfg.get("scale_factor")) or 1),
        temporal_patch=int(v.get("temporal_patch_size") or 1),
        tokens_per_image=1 if cross else int(cfg.get("mm_tokens_per_image") or 0),
        tiles=int(v.get("max_num_tiles") or 0) if cross else 0,
        cross_attention_layers=cross,
        grid_pinpoints=tuple((int(h), int(w)) for h, w in cfg.get("image_grid_pinpoints") or ()),
        anyres_max=int(aspect.removeprefix("anyres_max_")) if aspect.startswith("anyres_max_") else 0,
    )
    defaults = PROCESSOR_DEFAULTS.get(family)
    if defaults:
        owner = (
            "Qwen2VLImageProcessor" if dynamic else f"{'SmolVLM' if family == 'smolvlm' else 'Idefics3'}ImageProcessor"
        )
        return with_processor(tower, defaults, f"{owner}'s defaults")
    return tower


def vision_params(cfg: dict, tower: VisionTower | None, text_hidden: int) -> int:
    """A vision-language model's vision tower and projector, estimated from its vision_config and its `tower` (0
    without one): per encoder layer attention (4h²) and MLP (2·h·i), the patch embedding (c·p²·h, times the frames a
    patch spans) and the position table, and a two-layer projector into the language model (projector_params). A tiled
    tower (Llama 3.2 Vision: max_num_tiles) adds its global layers, a class position, and position tables per aspect
    ratio and tile."""
    if tower is None:
        return 0
    v, h, patch = cfg["vision_config"], tower.hidden_size, tower.patch_size
    channels = int(v.get("num_channels") or v.get("in_chans") or v.get("in_channels") or 3)
    positions = (int(v.get("image_size") or 0) // patch) ** 2
    tiles = int(v.get("max_num_tiles") or 0)
    if tiles:  # a class position; per aspect ratio a table for each tile's positions, and one before and after
        ratios = len(v.get("supported_aspect_ratios") or ()) + 1
        positions = (positions + 1) * (1 + ratios * tiles) + 2 * ratios * tiles + 1
    return (
        tower.num_layers * (4 * h * h + 2 * h * tower.intermediate_size)
        + channels * patch * patch * tower.temporal_patch * h
        + positions * h
        + projector_params(cfg, tower, text_hidden)
    )


def projector_params(cfg: dict, tower: VisionTower | None, text_hidden: int) -> int:
    """The projector from the vision tower into the language model, estimated as two layers (0 without a vision
    tower); one layer from vision_output_dim where the config names it (Llama 3.2 Vision)."""
    if tower is None:
        return 0
    v = cfg["vision_config"]
    if v.get("vision_output_dim"):
        return int(v["vision_output_dim"]) * text_hidden + text_hidden
    out = int(v.get("out_hidden_size") or tower.hidden_size)
    return out * text_hidden + text_hidden * text_hidden


def with_processor(tower: VisionTower, settings: dict, source: str) -> VisionTower:
    """The tower with a processor's resolution settings (min/max_pixels, longest_edge, tile_edge, splitting)."""
    known = {k: int(v) for k, v in settings.items() if k in _SETTINGS and v is not None}
    if not known:
        return tower
    return replace(tower, **{k: bool(v) if k == "splitting" else v for k, v in known.items()}, processor_source=source)


_SETTINGS = ("min_pixels", "max_pixels", "max_tiles", "longest_edge", "tile_edge", "splitting")


def processor_settings(saved: dict) -> dict:
    """The resolution settings of a saved image processor (preprocessor_config.json, or processor_config.json's
    image_processor): Qwen-VL's size {shortest_edge, longest_edge} in pixels (or min_pixels/max_pixels), Idefics3's
    size {longest_edge} and max_image_size {longest_edge}, do_image_splitting; Llama 3.2 Vision's max_image_tiles."""
    size = saved.get("size") if isinstance(saved.get("size"), dict) else {}
    out: dict[str, int] = {}
    if saved.get("max_image_tiles"):
        out["max_tiles"] = saved["max_image_tiles"]
    if "min_pixels" in saved or "max_pixels" in saved or "merge_size" in saved:  # counted in pixels
        out["min_pixels"] = saved.get("min_pixels") or size.get("shortest_edge")
        out["max_pixels"] = saved.get("max_pixels") or size.get("longest_edge")
    elif isinstance(saved.get("max_image_size"), dict):
        out["longest_edge"] = size.get("longest_edge")
        out["tile_edge"] = saved["max_image_size"].get("longest_edge")
        out["splitting"] = int(bool(saved.get("do_image_splitting", True)))
    return {k: v for k, v in out.items() if v is not None}


def folder_processor(folder: Path) -> dict:
    """A model folder's saved image-processor settings ({} where it has none)."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = folder / name
        if not path.is_file():
            continue
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        saved = saved.get(key, {}) if key else saved
        if isinstance(saved, dict) and saved:
            return processor_settings(saved)
    return {}


@dataclass(frozen=True)
class ImageGeometry:
    """One image at the largest the processor makes it: what the tower and the language model see of it."""

    patches: int  # positions the tower runs over (all tiles; the class position included)
    tokens: int  # image tokens the language model sees
    tiles: int  # crops the tower encodes separately (1, or Idefics3's tiles and global view)
    patches_per_tile: int  # the attention span of the tower (one tile's positions)
    rule: str  # how, in words
    source: str  # where the resolution comes from


def image_geometry(tower: VisionTower, image=None) -> ImageGeometry:
    """The patches and image tokens of the largest image the processor makes (see the module docstring); `image`:
    data.image (its max_pixels, min_pixels and processor settings override the model's)."""
    if tower.dynamic:
        return _dynamic(tower, image)
    if tower.cross_attention_layers:
        return _cross_attention(tower, image)
    if tower.grid_pinpoints:
        return _anyres(tower, image)
    if tower.family in TILED:
        return _tiled(tower, image)
    side = tower.image_size // tower.patch_size
    grid = side * side
    patches = grid + (1 if tower.cls_token else 0)
    tokens = tower.tokens_per_image or grid + (1 if tower.cls_token and tower.keep_cls else 0)
    rule = f"({tower.image_size}/{tower.patch_size})² = {grid} patches"
    if tower.cls_token:
        rule += " and the tower's class position" + (", all seen" if tower.keep_cls else ", which the projector drops")
    rule += f", pooled to {tower.tokens_per_image} tokens" if tower.tokens_per_image else ""
    return ImageGeometry(patches, tokens, 1, patches, rule, f"the tower's image_size {tower.image_size}")


def _dynamic(tower: VisionTower, image) -> ImageGeometry:
    configured = getattr(image, "max_pixels", None)
    max_pixels = configured or tower.max_pixels or PROCESSOR_DEFAULTS["qwen2_vl"]["max_pixels"]
    source = (
        f"data.image.max_pixels {max_pixels:,}"
        if configured
        else f"max_pixels {max_pixels:,} ({tower.processor_source or 'Qwen2VLImageProcessor defaults'})"
    )
    factor = tower.patch_size * tower.merge
    min_pixels = getattr(image, "min_pixels", None) or tower.min_pixels or factor * factor
    blocks = max(max_pixels // (factor * factor), math.ceil(min_pixels / (factor * factor)), 1)
    patches = blocks * tower.merge * tower.merge
    rule = (
        f"smart_resize: at most {max_pixels:,} pixels in {factor}-pixel blocks = {blocks} tokens of "
        f"{tower.merge}×{tower.merge} patches of {tower.patch_size} px"
    )
    return ImageGeometry(patches, blocks, 1, patches, rule, source)


def _tiled(tower: VisionTower, image) -> ImageGeometry:
    asked = getattr(image, "processor", None) or {}  # data.image.processor, by the processor's own names
    size, tiles_asked = asked.get("size") or {}, asked.get("max_image_size") or {}
    configured = size.get("longest_edge") if isinstance(size, dict) else None
    splitting = tower.splitting if asked.get("do_image_splitting") is None else bool(asked["do_image_splitting"])
    edge = int(configured or tower.longest_edge or tower.image_size)
    tile = int((tiles_asked.get("longest_edge") if isinstance(tiles_asked, dict) else 0) or tower.tile_edge)
    tile = tile or tower.image_size
    side = tower.image_size // tower.patch_size
    per_tile = side * side
    tokens_per_tile = per_tile // (tower.merge * tower.merge)
    n = math.ceil(edge / tile)
    tiles = n * n + 1 if splitting and n > 1 else 1
    source = (
        f"data.image.processor size.longest_edge {edge}"
        if configured
        else f"longest_edge {edge}, tiles of {tile} ({tower.processor_source or 'the tower image_size'})"
    )
    rule = (
        f"{tiles} tile{'s' if tiles > 1 else ''} ({n}×{n} and a global view)" if tiles > 1 else "1 tile"
    ) + f" of ({tower.image_size}/{tower.patch_size})² = {per_tile} patches, {tokens_per_tile} tokens each"
    return ImageGeometry(tiles * per_tile, tiles * tokens_per_tile, tiles, per_tile, rule, source)


def _cross_attention(tower: VisionTower, image) -> ImageGeometry:
    asked = getattr(image, "processor", None) or {}  # data.image.processor, by the processor's own names
    configured = asked.get("max_image_tiles")
    tiles = int(configured or tower.max_tiles or tower.tiles or 1)
    side = tower.image_size // tower.patch_size
    per_tile = -(-(side * side + 1) // 8) * 8  # the tower pads each tile's positions to a multiple of 8
    source = (
        f"data.image.processor max_image_tiles {tiles}"
        if configured
        else f"max_image_tiles {tiles} ({tower.processor_source or 'the tower max_num_tiles'})"
    )
    rule = (
        f"up to {tiles} tile{'s' if tiles > 1 else ''} of ({tower.image_size}/{tower.patch_size})² = {side * side} "
        f"patches and a class position (padded to {per_tile}); one image token in the text, the tiles read through "
        f"{tower.cross_attention_layers} cross-attention layer{'s' if tower.cross_attention_layers > 1 else ''}"
    )
    return ImageGeometry(tiles * per_tile, 1, tiles, per_tile, rule, source)


def _anyres(tower: VisionTower, image) -> ImageGeometry:
    """LLaVA-NeXT / OneVision: at each grid pinpoint (an image of that shape fills it, nothing is unpadded) the base
    view's tokens, rows x cols tiles of side² features each, and a newline token per feature row; OneVision pools
    the features above ~1.1 x anyres_max tiles' worth down by their ratio, as its processor counts them. The grids:
    data.image.processor image_grid_pinpoints where set, else the model's."""
    asked = (getattr(image, "processor", None) or {}).get("image_grid_pinpoints")
    grids = tuple((int(h), int(w)) for h, w in asked) if asked else tower.grid_pinpoints
    side = tower.image_size // tower.patch_size
    per_tile = side * side + (1 if tower.cls_token else 0)
    base = side * side + (1 if tower.cls_token and tower.keep_cls else 0)
    tokens, tiles = base, 1
    for height, width in grids:
        rows, cols = max(1, height // tower.image_size), max(1, width // tower.image_size)
        fh, fw = rows * side, cols * side
        features, newlines = fh * fw, fh
        if tower.anyres_max:
            ratio = math.sqrt(fh * fw / (tower.anyres_max * side * side))
            if ratio > 1.1:
                features, newlines = int(fh // ratio) * int(fw // ratio), int(fh // ratio)
        tokens, tiles = max(tokens, base + features + newlines), max(tiles, 1 + rows * cols)
    largest = max(grids, key=lambda hw: hw[0] * hw[1])
    rule = (
        f"anyres: a base view and up to {tiles - 1} tiles of ({tower.image_size}/{tower.patch_size})² = {side * side} "
        f"patches (grid pinpoints up to {largest[0]}x{largest[1]}), one newline token per feature row"
        + (f", tile features pooled to about {tower.anyres_max} tiles' worth" if tower.anyres_max else "")
    )
    source = "data.image.processor image_grid_pinpoints" if asked else "the model's image_grid_pinpoints"
    return ImageGeometry(tiles * per_tile, tokens, tiles, per_tile, rule, source)
