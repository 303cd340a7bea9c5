"""What ft does with a vision-language model, known before the model is loaded (the model's facts say it has a vision
tower): which method and data layout it trains through the model's processor, and what of the vision side trains.

`ft validate` and `ft plan` run these rules (with the facts at hand), so a refused combination never fails at step 1.
SFT trains on chat records with images and DPO on preference pairs whose prompts hold images (finetune/vision.py); the
other methods (and a model folder without processor files) train a vision-language model's language side on text, as
for any model.
"""

from __future__ import annotations

from finetune.catalog_vision import ImageGeometry, image_geometry
from finetune.errors import Problem
from finetune.vision import PACKABLE

_TRAIN_VISION = ("model", "train_vision")


def trains_images(config, facts) -> bool:
    """The job trains a vision-language model through its processor: the model has a vision tower and its processor
    files, and the method trains on images (SFT, DPO). A vision-language model without processor files trains its
    language side on text, as before."""
    return facts.vision_params > 0 and facts.image_processor and config.method.images


def images_per_sample(config) -> int:
    """Images in one training sequence the plan sizes for: data.image.per_sample (the planner sets it from the prepared
    data where ft train has it), else 1."""
    return config.data.image.per_sample or 1


def geometry(config, facts) -> ImageGeometry | None:
    """The patches and tokens of the largest image the job's processor makes (catalog_vision.py); None where the job
    does not train on images or the tower's shape is unknown."""
    if facts.vision_tower is None or not trains_images(config, facts):
        return None
    return image_geometry(facts.vision_tower, config.data.image)


def seq_len_problem(config, facts) -> Problem | None:
    """data.seq_len too short for the image tokens of the images per sample the plan assumes, plus one text token."""
    g = geometry(config, facts)
    if g is None:
        return None
    n, seq_len = images_per_sample(config), config.data.seq_len
    if seq_len > n * g.tokens:
        return None
    fix = f"raise data.seq_len above {n * g.tokens}"
    if facts.vision_tower.dynamic:
        fix += " or lower data.image.max_pixels (fewer tokens per image)"
    elif facts.vision_tower.grid_pinpoints:
        fix += " or give smaller grids in data.image.processor image_grid_pinpoints (fewer tiles per image)"
    elif g.tiles > 1:
        fix += " or lower data.image.processor size.longest_edge (fewer tiles per image)"
    return Problem(
        (("data", "seq_len"),),
        f"{n} image{'s' if n > 1 else ''} per sample of up to {g.tokens} image tokens each ({g.rule}; {g.source}) "
        f"leave no room for text in {seq_len} tokens",
        fix,
    )


def vision_problems(config, facts) -> list[Problem]:
    """Every problem of the vision settings on this model, all at once."""
    out = []
    overflow = seq_len_problem(config, facts)
    if overflow is not None:
        out.append(overflow)
    chosen = config.model.train_vision
    if chosen != "auto" and not trains_images(config, facts):
        if facts.vision_params == 0:
            why = "has no vision tower"
        elif not facts.image_processor:
            why = "has no processor files (preprocessor_config.json or processor_config.json)"
        else:
            why = f"trains on text with {config.method.name}"
        out.append(
            Problem(
                (_TRAIN_VISION,),
                f"{chosen} applies to vision-language SFT, but this job {why}",
                "remove model.train_vision",
            )
        )
    family = facts.vision_model_type or facts.model_type
    if trains_images(config, facts) and config.data.packing and family not in PACKABLE:
        why = (
            "its image tokens take 3-D positions the model computes per row (M-RoPE), which a packed row would mix"
            if "qwen" in family or "glm" in family
            else "its images are attended in ways a packed row would mix (cross-attention to the images, or "
            "bidirectional attention over them)"
        )
        out.append(
            Problem(
                (("data", "packing"), ("model", "name")),
                f"ft packs the samples of a vision-language model only for families whose image tokens take ordinary "
                f"positions ({', '.join(PACKABLE)}); {family}: {why}",
                "set data.packing: false",
            )
        )
    return out


def train_vision(config, adapter: str) -> tuple[str, str]:
    """(what of the vision side trains, why) for the chosen adapter: model.train_vision, or with `auto` the projector
    under full fine-tuning (it maps the images into the language model being retrained) and nothing under an adapter
    (the adapter on the language model learns to read the projector's output as it is)."""
    chosen = config.model.train_vision
    if chosen != "auto":
        return chosen, "model.train_vision"
    if adapter == "full":
        return (
            "projector",
            "full fine-tuning retrains the language model: its projector trains with it, the tower stays",
        )
    return "none", f"the {adapter} adapter on the language model learns to read the frozen tower and projector"
