"""Tiny vision-language models of other families than ft's own (finetune/tiny.py builds ft-tiny-vision, a LLaVA),
built by the tests: LLaVA-NeXT, Gemma 3, Idefics3 and Llama 3.2 Vision, each saved with its processor, sharing
ft-tiny-vision's tokenizer, language-model shape and tower shape."""

from __future__ import annotations

from pathlib import Path

from finetune.tiny import (
    IMAGE_TOKEN,
    TEMPLATE_TOKENS,
    VLM_TEMPLATE,
    build_tokenizer,
    build_vlm,
    save_with_processor,
    text_config,
    vision_config,
)


def build_llava_next_vlm(out_dir: str | Path, seed: int = 0, image_size: int = 32, patch: int = 8):
    """A tiny LLaVA-NeXT (anyres: each image resized to the best of three grid pinpoints and cut into tiles of
    image_size beside a base view; build_vlm's tower and language model) with its processor, saved to out_dir."""
    grids = [[image_size, 2 * image_size], [2 * image_size, image_size], [2 * image_size, 2 * image_size]]
    return build_vlm(out_dir, seed, image_size, patch, grids)


def image_template(marker: str) -> str:
    """VLM_TEMPLATE with another family's image marker."""
    return VLM_TEMPLATE.replace("'<image>'", f"'{marker}'")


def build_gemma3_vlm(out_dir: str | Path, seed: int = 0, image_size: int = 32, patch: int = 8):
    """A tiny Gemma 3 (a 1-layer SigLIP tower pooled to 4 image tokens, a 2-layer Gemma 3 text model with sliding
    and global layers) with its processor (image tokens attended bidirectionally: token_type_ids), saved to out_dir."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        PreTrainedTokenizerFast,
        SiglipVisionConfig,
    )

    marks = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    base = build_tokenizer(extra_special=(*TEMPLATE_TOKENS, *marks.values()))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        extra_special_tokens=marks,
    )
    template = image_template(marks["boi_token"])
    tokenizer.chat_template = template
    images = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=template, image_seq_length=4)
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=text_config(Gemma3TextConfig, tokenizer, head_dim=16, sliding_window=32),
        vision_config=vision_config(SiglipVisionConfig, image_size, patch),
        mm_tokens_per_image=4,
        boi_token_index=ids(marks["boi_token"]),
        eoi_token_index=ids(marks["eoi_token"]),
        image_token_index=ids(marks["image_token"]),
    )
    return save_with_processor(Gemma3ForConditionalGeneration, config, processor, out_dir, seed)


def build_idefics3_vlm(out_dir: str | Path, seed: int = 0, image_size: int = 32, patch: int = 8):
    """A tiny Idefics3 (SmolVLM's architecture: a 1-layer SigLIP-style tower, pixel shuffle to 4 image tokens, a
    2-layer Llama) with its processor, saved to out_dir."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    tokenizer = build_tokenizer(
        extra_special=(*TEMPLATE_TOKENS, "<fake_token_around_image>", IMAGE_TOKEN, "<global-img>", "<end_of_utterance>")
    )
    tokenizer.chat_template = VLM_TEMPLATE
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}, do_image_splitting=False
    )
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=VLM_TEMPLATE, image_seq_len=4
    )
    config = Idefics3Config(
        text_config=text_config(LlamaConfig, tokenizer),
        vision_config=vision_config(Idefics3VisionConfig, image_size, patch),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
    )
    return save_with_processor(Idefics3ForConditionalGeneration, config, processor, out_dir, seed)


def build_mllama_vlm(out_dir: str | Path, seed: int = 0, image_size: int = 32, patch: int = 8):
    """A tiny Llama 3.2 Vision (mllama: a tiled tower of one local and one global layer, up to 2 tiles an image; a
    3-layer language model whose middle layer cross-attends to the tiles) with its processor (one <|image|> token per
    image, the cross_attention_mask), saved to out_dir."""
    from transformers import (
        MllamaConfig,
        MllamaForConditionalGeneration,
        MllamaImageProcessorPil,
        MllamaProcessor,
        MllamaTextConfig,
        MllamaVisionConfig,
        PreTrainedTokenizerFast,
    )

    marker, bos = "<|image|>", "<|begin_of_text|>"
    base = build_tokenizer(extra_special=(*TEMPLATE_TOKENS, marker, bos))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, eos_token=base.eos_token, pad_token=base.pad_token, bos_token=bos
    )
    template = "{{ bos_token }}" + image_template(marker)  # the processor adds nothing to a text that opens with it
    tokenizer.chat_template = template
    images = MllamaImageProcessorPil(size={"height": image_size, "width": image_size}, max_image_tiles=2)
    processor = MllamaProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)
    vision = MllamaVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_global_layers=1,
        attention_heads=2,
        image_size=image_size,
        patch_size=patch,
        max_num_tiles=2,
        vision_output_dim=64,  # the last layer's output and one intermediate layer's, concatenated
        intermediate_layers_indices=[0],
        supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
    )
    text = MllamaTextConfig(  # text_config's shape, a third layer: the cross-attention one
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        cross_attention_layers=[1],
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    config = MllamaConfig(
        vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(marker)
    )
    import torch

    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(config)
    with torch.no_grad():  # transformers starts the cross-attention gates at 0, which hides the images from a new model
        for name, param in model.named_parameters():
            if "cross_attn_attn_gate" in name or "cross_attn_mlp_gate" in name:
                param.fill_(1.0)
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return model, processor


VLM_FAMILIES = {
    "llava": build_vlm,
    "gemma3": build_gemma3_vlm,
    "idefics3": build_idefics3_vlm,
    "llava_next": build_llava_next_vlm,
    "mllama": build_mllama_vlm,
}
