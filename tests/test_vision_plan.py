"""The planner's side of vision-language models (issue 33): the tower's shape read from transformers' own configs, the
patches and image tokens of the largest image each family's processor makes (checked against the processors), the
vision activations in memory and the tower in step time, the images per sample assumed, and seq_len refused at plan
time when the image tokens leave no room for text."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from finetune.catalog import from_hf_config
from finetune.catalog_vision import (
    PROCESSOR_DEFAULTS,
    image_geometry,
    processor_settings,
    vision_tower,
    with_processor,
)
from finetune.config import loads
from finetune.config.schema import ImageSection
from finetune.errors import ConfigError
from finetune.hardware import parse
from finetune.plan import plan
from finetune.plan.memory import VISION
from tests.helpers import REPO

COLOURS = REPO / "examples/data/colours/train.jsonl"


def facts_of(config) -> object:
    """ModelFacts of a transformers config object, as a model with processor files."""
    return replace(from_hf_config(config.to_dict(), config.model_type), image_processor=True)


def qwen2_vl():
    from transformers import Qwen2VLConfig

    text = {"hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8}
    vision = {"depth": 4, "embed_dim": 256, "hidden_size": 512, "num_heads": 4}
    text.update(num_key_value_heads=2, vocab_size=1000, bos_token_id=None, eos_token_id=1)
    return facts_of(Qwen2VLConfig(text_config=text, vision_config=vision))


def job(overrides=(), model="qwen", seq_len=4096, adapter="full"):
    text = (
        f"model: {{name: {model}}}\ndata: {{datasets: [{{path: {COLOURS}, format: chat}}], seq_len: {seq_len}}}\n"
        f"adapter: {{type: {adapter}}}\ntrain: {{global_batch_size: 4, micro_batch_size: 4}}\noutput: {{dir: run}}\n"
    )
    return loads(text, overrides=list(overrides), environ={})


# ---------------------------------------------------------------- facts and geometry, per family
def test_llava_reads_its_clip_tower_and_sees_every_patch_but_the_class_position():
    from transformers import LlavaConfig

    tower = facts_of(LlavaConfig()).vision_tower  # CLIP ViT-L/14 at 336 px, LLaVA-1.5's
    assert (tower.hidden_size, tower.num_layers, tower.num_heads, tower.intermediate_size) == (1024, 24, 16, 4096)
    g = image_geometry(tower)
    assert (g.patches, g.tokens) == (24 * 24 + 1, 24 * 24)  # the "default" feature strategy drops the class position
    full = facts_of(LlavaConfig(vision_feature_select_strategy="full")).vision_tower
    assert image_geometry(full).tokens == 24 * 24 + 1


def test_gemma3_pools_its_siglip_patches_to_mm_tokens_per_image():
    from transformers import Gemma3Config

    vision = {"image_size": 896, "patch_size": 14, "hidden_size": 1152, "intermediate_size": 4304}
    tower = facts_of(Gemma3Config(vision_config={**vision, "num_hidden_layers": 27})).vision_tower
    g = image_geometry(tower)
    assert (g.patches, g.tokens, tower.num_layers) == (64 * 64, 256, 27)


def test_idefics3_tiles_match_its_image_processor():
    """Idefics3's processor splits an image resized to longest_edge into tiles plus a global view (its own
    get_number_of_image_patches counts them); each tile is pixel-shuffled to image_seq_len tokens, the processor's
    formula ((image_size // patch_size)² / scale_factor²)."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil

    tower = facts_of(Idefics3Config(vision_config={"image_size": 364, "patch_size": 14})).vision_tower
    g = image_geometry(tower)
    tiles, _, _ = Idefics3ImageProcessorPil().get_number_of_image_patches(1456, 1456)
    assert g.tiles == tiles == 17
    assert g.tokens == 17 * int((364 // 14) ** 2 / 2**2) == 17 * 169
    assert (g.patches, g.patches_per_tile) == (17 * 676, 676)
    # a smaller longest_edge set through data.image.processor: fewer tiles, as the processor makes them
    image = ImageSection(processor={"size": {"longest_edge": 728}})
    small = Idefics3ImageProcessorPil(size={"longest_edge": 728}).get_number_of_image_patches(728, 728)[0]
    assert image_geometry(tower, image).tiles == small == 5


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_tokens_are_the_processors_at_its_max_pixels(family):
    """Dynamic resolution: the largest image smart_resize makes at max_pixels (the processor's default, or
    data.image.max_pixels) has as many patches as Qwen2VLImageProcessor gives it, and no image has more."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLImageProcessorPil

    if family == "qwen2_vl":
        config = Qwen2VLConfig()
    else:  # Qwen2.5-VL-7B's tower (transformers' class default names its output width as the tower's)
        config = Qwen2_5_VLConfig(vision_config={"hidden_size": 1280, "out_hidden_size": 3584})
    tower = facts_of(config).vision_tower
    assert (tower.hidden_size, tower.num_layers, tower.merge, tower.gated_mlp) == (1280, 32, 2, family == "qwen2_5_vl")
    g = image_geometry(tower)
    processor = Qwen2VLImageProcessorPil()
    assert g.patches == processor.get_number_of_image_patches(896, 1120) == 32 * 40 * 4  # 1,003,520 pixels exactly
    assert (g.tokens, g.patches) == (1280, 5120)
    for h, w in ((4000, 3000), (2000, 2000), (100, 5000), (1080, 1920)):
        assert processor.get_number_of_image_patches(h, w) <= g.patches
    image = ImageSection(max_pixels=256 * 28 * 28)
    small = image_geometry(tower, image)
    limited = Qwen2VLImageProcessorPil(max_pixels=256 * 28 * 28)
    assert small.tokens == 256 and limited.get_number_of_image_patches(448, 448) == small.patches == 1024
    assert "data.image.max_pixels" in small.source


def test_processor_defaults_are_transformers_own():
    from transformers import Idefics3ImageProcessorPil, Qwen2VLImageProcessorPil, SmolVLMImageProcessorPil

    size = Qwen2VLImageProcessorPil.size
    for family in ("qwen2_vl", "qwen2_5_vl"):
        assert PROCESSOR_DEFAULTS[family] == {"min_pixels": size["shortest_edge"], "max_pixels": size["longest_edge"]}
    for family, cls in (("idefics3", Idefics3ImageProcessorPil), ("smolvlm", SmolVLMImageProcessorPil)):
        edge, tile = cls.size["longest_edge"], cls.max_image_size["longest_edge"]
        assert PROCESSOR_DEFAULTS[family] == {"longest_edge": edge, "tile_edge": tile, "splitting": 1}


def test_a_saved_processor_sizes_the_images():
    """A model folder's preprocessor_config.json (its max_pixels) replaces the family's defaults."""
    saved = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 128 * 28 * 28}
    settings = processor_settings(saved)
    assert settings == {"min_pixels": 3136, "max_pixels": 128 * 28 * 28}
    tower = with_processor(qwen2_vl().vision_tower, settings, "the model's preprocessor_config.json")
    g = image_geometry(tower)
    assert g.tokens == 128 and "preprocessor_config.json" in g.source


@pytest.mark.parametrize("family", ["llava", "gemma3", "idefics3"])
def test_image_tokens_are_what_the_tiny_models_processor_inserts(tmp_path, family):
    """ft's tiny vision-language models, read as a folder (facts and processor files): the image tokens the plan counts
    are the ones their own processor puts into a sample."""
    from PIL import Image
    from transformers import AutoProcessor

    from finetune.catalog import resolve
    from tests.vlm_builders import VLM_FAMILIES

    VLM_FAMILIES[family](tmp_path / "m")
    facts = resolve(str(tmp_path / "m"))
    processor = AutoProcessor.from_pretrained(str(tmp_path / "m"))
    marker = {"llava": "<image>", "gemma3": "<start_of_image>", "idefics3": "<image>"}[family]
    ids = processor(text=[f"look {marker} here"], images=[Image.new("RGB", (32, 32), "red")])["input_ids"][0]
    soft = {"gemma3": "<image_soft_token>"}.get(family, "<image>")  # the token each image position takes
    image_id = processor.tokenizer.convert_tokens_to_ids(soft)
    assert image_geometry(facts.vision_tower).tokens == sum(1 for t in ids if int(t) == image_id)


def test_llava_next_counts_the_most_tokens_its_processor_inserts_for_any_image(tmp_path):
    """anyres: the image tokens LLaVA-NeXT's processor inserts vary with the image's shape and size (tiles of the best
    grid pinpoint, unpadded, a newline per row); the plan counts the most any image gets (an image of the largest
    pinpoint's shape) and the tower's patches of the base view and every tile."""
    from PIL import Image
    from transformers import AutoProcessor

    from finetune.catalog import resolve
    from tests.vlm_builders import build_llava_next_vlm

    build_llava_next_vlm(tmp_path / "m")
    facts = resolve(str(tmp_path / "m"))
    processor = AutoProcessor.from_pretrained(str(tmp_path / "m"))
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    counts, crops = [], []
    for size in [(32, 32), (64, 32), (32, 64), (64, 64), (100, 100), (20, 60), (500, 300), (33, 97)]:
        out = processor(text=["look <image> here"], images=[Image.new("RGB", size, "red")], return_tensors="pt")
        counts.append(sum(1 for t in out["input_ids"][0] if int(t) == image_id))
        crops.append(out["pixel_values"].shape[1])
    g = image_geometry(facts.vision_tower)
    assert len(set(counts)) > 2 and g.tokens == max(counts) == 88, counts
    assert g.tiles == max(crops) == 5 and g.patches == 5 * (16 + 1) and "anyres" in g.rule
    # data.image.processor's grids replace the model's, for the plan as for the processor
    grids = [[32, 64], [64, 32]]
    processor.image_processor.image_grid_pinpoints = grids
    counts = [
        sum(1 for t in processor(text=["<image>"], images=[Image.new("RGB", s)])["input_ids"][0] if int(t) == image_id)
        for s in [(32, 32), (64, 32), (32, 64), (64, 64), (20, 60)]
    ]
    small = image_geometry(facts.vision_tower, ImageSection(processor={"image_grid_pinpoints": grids}))
    assert small.tokens == max(counts) == 56 and "data.image.processor" in small.source


def test_llava_onevision_pools_its_tiles_as_its_processor_counts_them():
    """OneVision (anyres_max_9) at its released shape: SigLIP 384/14 and grid pinpoints up to 6x6 tiles; the features
    of a grid above ~1.1 x 9 tiles' worth are pooled down to it. The count is checked against transformers' own
    LlavaOnevisionProcessor arithmetic (its _get_unpadded_features, called on the settings it reads)."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    grids = [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)]
    cfg = {
        "model_type": "llava_onevision",
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "num_hidden_layers": 26,
            "num_attention_heads": 16,
            "intermediate_size": 4304,
            "image_size": 384,
            "patch_size": 14,
        },
        "image_grid_pinpoints": grids,
        "vision_aspect_ratio": "anyres_max_9",
        "vision_feature_select_strategy": "full",
    }
    tower = vision_tower(cfg)
    g = image_geometry(tower)
    side = 384 // 14
    theirs = SimpleNamespace(vision_aspect_ratio="anyres_max_9")
    want = max(
        side * side + sum(LlavaOnevisionProcessor._get_unpadded_features(theirs, h, w, side, side, h // 384, w // 384))
        for h, w in grids
    )
    # the most: a 5x2 grid (135 x 54 features, under the pooling threshold; 135 newlines), not 6x6 (pooled to 81x81)
    assert g.tokens == want == 729 + 135 * 54 + 135
    assert g.tiles == 37 and g.patches == 37 * 729


# ---------------------------------------------------------------- the plan: memory, step time, seq_len, explanation
def planned(facts, overrides=(), images_per_sample=None, **kw):
    return plan(job(overrides, **kw), parse("1xH100-80GB"), facts, images_per_sample=images_per_sample)


def test_vision_memory_grows_with_max_pixels_and_with_a_trained_tower():
    facts = qwen2_vl()
    small = planned(facts, ["data.image.max_pixels=200704"])
    large = planned(facts, ["data.image.max_pixels=1003520"])
    assert 0 < small.estimate.device[VISION] < large.estimate.device[VISION]
    assert small.image_tokens == 256 and large.image_tokens == 1280
    frozen = planned(facts, ["model.train_vision=none", "train.gradient_checkpointing=false"])
    trained = planned(facts, ["model.train_vision=all", "train.gradient_checkpointing=false"])
    assert trained.estimate.device[VISION] > 3 * frozen.estimate.device[VISION]  # 4 layers saved against 1 in flight
    assert sum(trained.step_seconds.values()) > sum(frozen.step_seconds.values())
    checkpointed = planned(facts, ["model.train_vision=all", "train.gradient_checkpointing=true"])
    assert checkpointed.estimate.device[VISION] < trained.estimate.device[VISION]


def test_images_per_sample_multiply_the_tower_and_come_from_the_data_when_prepared():
    facts = qwen2_vl()
    one = planned(facts, ["data.image.max_pixels=200704"])
    three = planned(facts, ["data.image.max_pixels=200704"], images_per_sample=3)
    assert (one.images_per_sample, three.images_per_sample) == (1, 3)
    assert three.estimate.device[VISION] > 2.5 * one.estimate.device[VISION]
    assert "assumed" in one.decision("images_per_sample").reason
    assert "prepared row" in three.decision("images_per_sample").reason
    asked = planned(facts, ["data.image.max_pixels=200704", "data.image.per_sample=2"], images_per_sample=3)
    assert asked.images_per_sample == 2 and asked.decision("images_per_sample").source == "config"


def test_a_seq_len_without_room_for_the_image_tokens_is_refused_at_plan_time():
    facts = qwen2_vl()
    with pytest.raises(ConfigError) as e:
        planned(facts, seq_len=1024)  # the default max_pixels: up to 1280 tokens an image
    text = str(e.value)
    assert "data.seq_len" in text and "1280" in text and "data.image.max_pixels" in text
    planned(facts, ["data.image.max_pixels=200704"], seq_len=1024)  # 256 tokens an image: fits
    with pytest.raises(ConfigError, match="data.seq_len"):
        planned(facts, ["data.image.max_pixels=200704"], seq_len=1024, images_per_sample=4)


def test_ft_plan_names_the_image_figures(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "job.yaml"
    path.write_text(
        f"model: {{name: ft-tiny-vision}}\ndata: {{datasets: [{{path: {COLOURS}, format: chat}}], seq_len: 64}}\n"
        f"adapter: {{type: full}}\ntrain: {{global_batch_size: 4}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "plan", str(path), "--hardware", "1xH100-80GB"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert "16" in lines["image_tokens"] and "image_size 32" in lines["image_tokens"]
    assert "17" in lines["image_patches"]
    assert "assumed" in lines["images_per_sample"]
    assert "frozen" in lines["vision_activations"]
    assert "vision activations" in r.stdout


def two_image_job(tmp_path) -> Path:
    """ft-tiny-vision on four colour records, one of which holds its image twice."""
    from finetune.tiny import image_records, write_jsonl

    rows = image_records(4, tmp_path / "data")
    parts = rows[0]["messages"][0]["content"]
    rows[0]["messages"][0]["content"] = [parts[0], parts[0], parts[1]]
    write_jsonl(rows, tmp_path / "data" / "train.jsonl")
    path = tmp_path / "job.yaml"
    path.write_text(
        f"model: {{name: ft-tiny-vision}}\ndata: {{datasets: [{{path: {tmp_path / 'data' / 'train.jsonl'}, format: "
        f"chat}}], seq_len: 64, validation: 0, cache_dir: {tmp_path / 'cache'}}}\nadapter: {{type: full}}\n"
        f"train: {{global_batch_size: 2, max_steps: 1}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    return path


def test_the_prepared_summary_records_the_most_images_in_a_row(tmp_path):
    from finetune.config import load
    from finetune.data.preprocess import prepare

    config = load(two_image_job(tmp_path))
    assert prepare(config).summary["max_images_per_row"] == 2
    assert prepare(config).summary["max_images_per_row"] == 2  # reused from the cache


@pytest.mark.slow  # one training step
def test_ft_train_plans_for_the_prepared_rows_images(tmp_path):
    """The plan ft train writes is sized for the most images a prepared row holds, not the 1 it assumed before
    reading the data; a data.image.per_sample below it is refused with the key."""
    from finetune.artifacts.run import RunFolder
    from finetune.errors import FtError
    from tests.helpers import train_here

    path = two_image_job(tmp_path)
    train_here(path)
    written = json.loads(RunFolder(tmp_path / "run").plan_path.read_text())
    assert written["images_per_sample"] == 2
    assert next(d for d in written["decisions"] if d["field"] == "images_per_sample")["reason"].startswith("the most")
    with pytest.raises(FtError, match=r"data\.image\.per_sample: 1, but a prepared row holds 2 images"):
        train_here(path, "--set", "data.image.per_sample=1", "--set", f"output.dir={tmp_path / 'run2'}")


def test_saved_tower_activations_match_the_estimate():
    """What autograd saves for backward in a trained CLIP tower (parameters left out: they are the weights), measured
    with saved-tensor hooks as the tower trains and as it is frozen, against the estimate's trained tower less its
    output for the projector (which the frozen one holds too)."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from finetune.plan.setup import Setup
    from finetune.plan.transients import vision_activation_bytes

    vision = CLIPVisionConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=224,
        patch_size=16,
    )
    text = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=299)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    batch = {"input_ids": torch.tensor([[1] * 4 + [299] * 196 + [1] * 4]), "pixel_values": torch.randn(1, 3, 224, 224)}

    def saved(trains: bool) -> int:
        model.model.vision_tower.requires_grad_(trains)
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch)
        return sum(storages.values())

    measured = saved(True) - saved(False)
    tower = facts_of(config).vision_tower
    patches = image_geometry(tower).patches
    s = Setup("full", "none", "fp32", "adamw_torch", 1, 204, False, vision_patches=patches, tower_trains=True)
    estimated = vision_activation_bytes(facts_of(config), s, 4) - 4 * patches * tower.hidden_size
    print(f"tower saved for backward: measured {measured / 2**20:.2f} MiB, estimated {estimated / 2**20:.2f} MiB")
    assert 0.8 <= measured / estimated <= 1.25
