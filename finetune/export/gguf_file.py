"""One GGUF file from a transformers model, written with the gguf package: hyper-parameters under llama.cpp's keys,
tensors under the names gguf.TensorNameMap gives each architecture, the tokenizer (vocab.py).

Tensors are written as llama.cpp's graph for the architecture expects them (gguf_families.yaml says where they
differ from transformers): query and key rows reordered head by head where llama.cpp rotates adjacent pairs, 1 added
to Gemma's norm weights, queries scaled where transformers' query_pre_attn_scalar differs from the attention scale
llama.cpp fixes (Gemma 2/3), a tied output matrix left out (llama.cpp reuses the embeddings). Matrices are written in
the asked type (f32, f16 or bf16), vectors (norms, biases) in f32, as llama.cpp keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import FtError
from finetune.export.families import Family, head_dim, query_factor, rope, sliding_rope_theta
from finetune.export.vocab import VocabInfo, write_vocab

FLOAT_TYPES = ("f32", "f16", "bf16")  # what is written here; the other kinds are quantized from one (quantize.py)


@dataclass(frozen=True)
class Written:
    """What write_gguf wrote."""

    path: Path
    tensors: int
    vocab: VocabInfo


def _arch(row: Family):
    import gguf

    for arch, name in gguf.MODEL_ARCH_NAMES.items():
        if name == row.arch:
            return arch
    raise FtError(f"the gguf package knows no architecture {row.arch!r}.\n    fix: pip install -U gguf")


def _pairs(weight, heads: int):
    """Rows of a query/key projection reordered within each head from halves (transformers' rotary) to adjacent pairs
    (llama.cpp's): row 2j takes row j, row 2j+1 takes row j + head_dim/2."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _tensor(name: str, t, row: Family, config, queries: tuple[str, ...]):
    """The tensor as llama.cpp's graph for the family expects it; `queries`: the name endings of the tensors that
    scale the queries (the query norm where there is one, else the query projection)."""
    if row.rope_pairs and name.endswith(("q_proj.weight", "q_proj.bias")):
        t = _pairs(t, config.num_attention_heads)
    elif row.rope_pairs and name.endswith(("k_proj.weight", "k_proj.bias")):
        t = _pairs(t, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    if row.norm_offset and name.endswith("norm.weight"):
        t = t + row.norm_offset
    factor = query_factor(row, config)
    if factor != 1.0 and name.endswith(queries):  # linear up to llama.cpp's scale: rotary and softcap come after
        t = t * factor
    return t


def _array(t, kind: str):
    """(numpy array, gguf raw dtype or None) of a float tensor in `kind` (vectors always f32)."""
    import gguf
    import numpy as np
    import torch

    if t.ndim <= 1 or kind == "f32":
        return t.to(torch.float32).numpy(), None
    if kind == "f16":
        return t.to(torch.float16).numpy(), None
    data = t.to(torch.float32).numpy().astype(np.float32, copy=False)
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16


def _add_tensors(writer, model, row: Family, kind: str) -> int:
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(_arch(row), config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = model.state_dict()
    normed = any(name.endswith("q_norm.weight") for name in state)  # a norm after the projection undoes its scale
    queries = ("q_norm.weight",) if normed else ("q_proj.weight", "q_proj.bias")
    count = 0
    for name, t in state.items():
        if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise FtError(
                f"the model's tensor {name} has no name in llama.cpp's {row.arch} architecture: the model differs "
                "from the family ft writes.\n    fix: convert it with llama.cpp's own converter"
            )
        data, raw = _array(_tensor(name, t.detach().cpu().float(), row, config, queries), kind)
        writer.add_tensor(gguf_name, data, raw_dtype=raw)
        count += 1
    frequencies = _llama3_factors(config)
    if frequencies is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", frequencies)
        count += 1
    return count


def _llama3_factors(config):
    """Llama 3.1's rotary frequency factors (llama.cpp reads them as the rope_freqs tensor); None for other scalings."""
    import numpy as np

    params = rope(config)
    if params["rope_type"] != "llama3":
        return None
    dim = head_dim(config)
    factor = params.get("factor", 8.0)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    context = params.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * params["rope_theta"] ** (i / dim)
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_hyperparameters(writer, config, row: Family, name: str, file_type: int) -> None:
    import gguf

    heads = config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    params = rope(config)
    writer.add_rope_freq_base(params["rope_theta"])
    if params["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    if row.sliding == "layers" and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
        kinds = getattr(config, "layer_types", None)
        if kinds:
            writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
        if sliding_rope_theta(config):
            writer.add_rope_freq_base_swa(sliding_rope_theta(config))
    if row.softcap and getattr(config, "attn_logit_softcapping", None):
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_gguf(path: Path, model, tokenizer, tokenizer_dir: Path, row: Family, kind: str, meta: dict) -> Written:
    """Write `model` (a transformers model of family `row`) with its tokenizer (saved in tokenizer_dir) to `path`,
    matrices in `kind` (f32, f16, bf16). meta: name, chat_template, eot (the template's end-of-turn token)."""
    import gguf

    if kind not in FLOAT_TYPES:
        raise ValueError(f"write_gguf writes {FLOAT_TYPES}, not {kind!r}")
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    }[kind]
    writer = gguf.GGUFWriter(path, row.arch)
    try:
        _add_hyperparameters(writer, model.config, row, meta["name"], int(file_type))
        rows = model.get_input_embeddings().weight.shape[0]
        vocab = write_vocab(writer, tokenizer, tokenizer_dir, rows, meta["chat_template"], meta.get("eot"))
        writer.add_vocab_size(rows)
        tensors = _add_tensors(writer, model, row, kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return Written(path, tensors, vocab)
