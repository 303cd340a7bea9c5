"""Tokenizers and models per the config and the Plan: a whole model loaded by `from_pretrained`, or an empty
(meta-device) model with a safetensors reader that fills it piece by piece (see distributed/fsdp.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.config.schema import ModelSection
from finetune.errors import FtError

if TYPE_CHECKING:
    import torch

BUILT_IN = ("ft-tiny", "tiny", "ft-tiny-vision")  # built offline into ft's cache on first use (finetune/tiny.py)


def load_tokenizer(model: ModelSection):
    """The tokenizer named by model.tokenizer, else the model's own; ft-tiny's is built offline."""
    name = model.tokenizer or model.name
    key = "model.tokenizer" if model.tokenizer else "model.name"
    if name.lower() in BUILT_IN and not Path(name).exists():
        from finetune.tiny import ensure_model

        name = str(ensure_model(name))
    from transformers import AutoTokenizer

    from finetune import hub

    why = "" if Path(name).expanduser().exists() else hub.unreachable(name, model.revision)  # one try, no retries
    try:
        return AutoTokenizer.from_pretrained(
            name, revision=model.revision, trust_remote_code=model.trust_remote_code, local_files_only=bool(why)
        )
    except (OSError, ValueError) as e:
        if why:  # not in the local cache either
            raise FtError(hub.unreachable_message(name, key, why)) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FtError(
            f"{key}: cannot load a tokenizer from {name!r}: {first}. Use a local folder with tokenizer files, a "
            "hub id (online), or ft-tiny"
        ) from None


def add_special_tokens(tokenizer, tokens: list[str]) -> list[str]:
    """Add the tokens that are not yet single tokens; return those added (the model's embeddings must grow)."""
    vocab = tokenizer.get_vocab()
    new = [t for t in dict.fromkeys(tokens) if t not in vocab]
    if new:
        tokenizer.add_tokens(new, special_tokens=True)
    return new


def facts(model: ModelSection):
    """The model's facts (catalog.resolve: a local folder, the catalog, or the hub's config); ft-tiny-vision, which
    the catalog does not describe, is read from the folder it is built into."""
    from finetune.catalog import resolve

    vision = model.name.lower() == "ft-tiny-vision" and not Path(model.name).exists()
    return resolve(model_path(model) if vision else model.name, model.revision, model.trust_remote_code)


def model_path(model: ModelSection) -> str:
    """Where the weights come from: ft-tiny and ft-tiny-vision are built once into ft's cache; anything else as
    written."""
    if model.name.lower() in BUILT_IN and not Path(model.name).exists():
        from finetune.tiny import ensure_model

        return str(ensure_model(model.name))
    p = Path(model.name).expanduser()
    if (p.is_absolute() or model.name.startswith(".")) and not p.exists():
        raise FtError(
            f"model.name: the folder {model.name} does not exist; point it at a folder with config.json and "
            "safetensors weights, or use a hub id"
        )
    return str(p) if p.exists() else model.name


def torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def runtime_attention(model: ModelSection, planned: str, context_parallel: int = 1, upgrade: bool = True) -> str:
    """The attention kernel to run: the plan's, upgraded to flash-attention 2 where the plan allows it (`upgrade`:
    model.attn_implementation auto on GPUs, and a model class that loads flash_attention_2, plan/attention.py),
    flash-attn is installed and the GPU supports it (Ampere or newer). Packed batches work with either (flash-attention
    takes them as one varlen row, sliding windows included). Never upgraded under context parallelism: torch's ring
    attention replaces SDPA (distributed/cp.py)."""
    import importlib.util

    import torch

    if not upgrade or model.attn_implementation != "auto" or context_parallel > 1:
        return planned
    if (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 8
        and importlib.util.find_spec("flash_attn") is not None
    ):
        return "flash_attention_2"
    return planned


def load_dtype(model: ModelSection, plan) -> str:
    """The dtype the trained model's weights are held in: fp32 master weights for full fine-tuning (autocast computes
    in plan.precision), bf16 ones under plan.pure_bf16, else model.dtype or the plan's precision."""
    if plan.adapter == "full":
        return "bf16" if plan.pure_bf16 else "fp32"
    return model.dtype if model.dtype != "auto" else plan.precision


def load_model(
    model: ModelSection,
    plan,
    tokenizer=None,
    attn_implementation: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
):
    """The whole model on this rank as the plan says: dtype (`dtype` overrides it, e.g. for a frozen reference),
    attention kernel, 4/8-bit base, resized embeddings, checkpointing; a new score head (plan.head) starts from
    `head_value` with `seed`."""
    import torch

    attn = attn_implementation or plan.attn_implementation
    kwargs = {
        "attn_implementation": attn,
        "use_safetensors": True,
        "trust_remote_code": model.trust_remote_code,
        "dtype": torch_dtype(dtype or load_dtype(model, plan)),
        **head_options(plan, tokenizer),
    }
    path = model_path(model)
    if plan.quantization in ("nf4", "int8"):
        kwargs["quantization_config"] = quantization_config(plan, kept_modules(model, plan, path))
    accelerator = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    placement = device_map(plan, accelerator)
    if placement is not None:
        kwargs["device_map"] = placement
    register_attention(attn)
    try:
        net, info = auto_class(plan).from_pretrained(path, revision=model.revision, output_loading_info=True, **kwargs)
    except OSError as e:
        raise FtError(f"model.name: cannot load {model.name!r}: {str(e).splitlines()[0]}") from None
    init_head(net, [k for k in info.get("missing_keys", ()) if is_new_head(k)], seed)
    if tokenizer is not None:
        resize_embeddings(net, len(tokenizer))
    return finish_model(net, plan)


def kept_modules(model: ModelSection, plan, path: str) -> list[str]:
    """What a 4/8-bit base leaves unquantized besides a score head: on an MoE model (plan.moe) what peft adapts
    through target_parameters (finetune/experts.py, from the model's config at `path`); nothing on a dense model,
    which the plan knows: its loading reads no config and asks no hub for it."""
    if getattr(plan, "vision", False):  # bitsandbytes quantizes the language model only: the vision side stays
        from finetune.vision import unquantized_patterns

        return unquantized_patterns()
    if not plan.moe:
        return []
    from finetune.experts import kept_unquantized

    return kept_unquantized(path, model.trust_remote_code, auto_class(plan), model.revision)


def device_map(plan, accelerator: torch.device | None) -> dict | None:
    """Where from_pretrained puts the weights of a whole model (`accelerator`: this rank's GPU, None without one).
    `host` loading (a 4-bit base under FSDP2 that does not fit whole on the GPU): quantized in host RAM, always:
    given no device_map, bitsandbytes' quantizer would pick the current GPU (transformers 5.24
    quantizers/quantizer_bnb_4bit.py update_device_map), and fully_shard moves each layer to the GPU as it shards it
    (plan/candidates.py loading). `partitioned` (ZeRO-3): none, as from_pretrained then constructs the model
    partitioned (zero.Init) and refuses any device_map (integrations/accelerate.py check_and_set_device_map).
    Otherwise straight onto the GPU where there is one."""
    if plan.loading == "host":
        # an all-"cpu" map passes bitsandbytes' check (quantizer_bnb_4bit.py validate_environment refuses only maps
        # mixing cpu with GPUs) and allocates nothing on the GPU (modeling_utils.py caching_allocator_warmup skips
        # maps without an accelerator); Params4bit quantizes on the device it is moved to (nn/modules.py _quantize)
        return {"": "cpu"}
    if accelerator is None or plan.loading == "partitioned":
        return None
    return {"": accelerator.index}


def build_empty(model: ModelSection, plan, tokenizer, attn: str, dtype: str):
    """The model's modules with parameters on the meta device (no memory), from its config; embeddings resized to the
    tokenizer. The weights are filled later, shard by shard (distributed/fsdp.py)."""
    import torch
    from transformers import AutoConfig

    folder = weights_folder(model)
    config = AutoConfig.from_pretrained(
        str(folder), trust_remote_code=model.trust_remote_code, **head_options(plan, tokenizer)
    )
    register_attention(attn)
    with torch.device("meta"):
        net = auto_class(plan).from_config(
            config, dtype=torch_dtype(dtype), attn_implementation=attn, trust_remote_code=model.trust_remote_code
        )
    if tokenizer is not None and len(tokenizer) > net.get_input_embeddings().weight.shape[0]:
        # on meta: shapes only; rows are filled by fill_rows
        net.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return finish_model(net, plan)


# ---------------------------------------------------------------- the head: next-token logits, or one score
def auto_class(plan):
    """transformers' Auto class for the plan's head: a causal LM, or a sequence classifier with one output (reward
    models: its `score` layer reads the hidden state of each sequence's last token that is not padding)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    if plan.head == "score":
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if getattr(plan, "vision", False) else AutoModelForCausalLM


def head_options(plan, tokenizer) -> dict:
    """Config values a score head needs: one output, and the pad id it finds each sequence's last token by (the id
    ft pads batches with, saved in the model's config so that transformers finds the same token)."""
    if plan.head != "score":
        return {}
    from finetune.data.tokenize import pad_id

    return {"num_labels": 1, **({"pad_token_id": pad_id(tokenizer)} if tokenizer is not None else {})}


def is_new_head(name: str) -> bool:
    """A tensor of a sequence classifier's `score` layer (peft's copies of it included), which a causal LM's checkpoint
    does not have: it starts from `head_value`."""
    return "score" in name.split(".")


def head_value(name: str, shape: tuple, seed: int, std: float) -> torch.Tensor:
    """The starting value of a new score tensor (fp32, CPU): weights normal(0, std) as transformers initialises them,
    bias 0, drawn from a generator seeded by the job's seed and the tensor's role alone, so that every loading path
    and rank starts from the same head."""
    import torch

    value = torch.zeros(shape, dtype=torch.float32)
    role = name.rsplit(".", 1)[-1]  # weight or bias, whatever peft prefixes the name with
    if role != "weight":
        return value
    digest = hashlib.sha256(f"{seed}:score.{role}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.nn.init.normal_(value, std=std, generator=gen)


def head_std(net) -> float:
    return float(getattr(net.config.get_text_config(), "initializer_range", 0.02))


def init_head(net, names: list[str], seed: int) -> None:
    """Set the named score tensors of a whole (unsharded) model to their `head_value`."""
    import torch

    params = dict(net.named_parameters())
    with torch.no_grad():
        for name in names:
            p = params[name]
            p.copy_(head_value(name, tuple(p.shape), seed, head_std(net)).to(p.dtype))


def register_attention(attn: str) -> None:
    """Make ft's `sdpa_varlen` attention known to transformers before a model is built with it."""
    if attn == "sdpa_varlen":
        from finetune.attention import register

        register()


def finish_model(net, plan):
    """A loaded or built model made ready to train as the plan says: no generation cache, 4-bit layers trainable on
    the CPU, activation checkpointing where planned: on plan.checkpoint_layers decoder layers, or all of them when it is
    0 (every backend's loader ends here)."""
    net.config.use_cache = False
    if getattr(plan, "vision", False):  # what of the vision side trains (an adapter then freezes all of the base)
        from finetune.vision import freeze

        freeze(net, plan.train_vision)
    if plan.quantization == "nf4":
        from finetune.compat import keep_4bit_layers_trainable_on_cpu

        keep_4bit_layers_trainable_on_cpu(net)
    if plan.gradient_checkpointing:
        from finetune.activations import checkpoint_only

        enable = getattr(net, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpoint_only(net, plan.checkpoint_layers)
    return net


# ---------------------------------------------------------------- added tokens: new embedding rows
ROW_CHUNK = 4096  # rows summed at a time for the mean of an embedding table (the same chunks in every loading path)


def row_mean(chunks) -> torch.Tensor:
    """The mean row of a table given as consecutive row chunks, summed in float64 chunk by chunk: the same value
    whether the rows come from a whole tensor in memory or are read from a file piece by piece."""
    total, rows = None, 0
    for chunk in chunks:
        part = chunk.double().sum(0)
        total = part if total is None else total + part
        rows += chunk.shape[0]
    return total / rows


def resize_embeddings(net, size: int) -> None:
    """Grow the input embeddings (and an untied output head) to `size` rows; each new row is the mean of the old rows
    (deterministic, so every loading path gives the same rows; transformers' mean_resizing samples around that mean)."""
    import torch

    old = net.get_input_embeddings().weight.shape[0]
    if size <= old:
        return
    net.resize_token_embeddings(size, mean_resizing=False)
    tables = {
        id(m.weight): m.weight for m in (net.get_input_embeddings(), net.get_output_embeddings()) if m is not None
    }
    with torch.no_grad():
        for w in tables.values():
            w[old:] = row_mean(w[s : min(s + ROW_CHUNK, old)] for s in range(0, old, ROW_CHUNK)).to(w.dtype)


def quantization_config(plan, kept: list[str] = ()):
    """bitsandbytes' settings; `kept`: modules it leaves unquantized besides a score head (finetune/experts.py)."""
    from transformers import BitsAndBytesConfig

    compute = torch_dtype(plan.precision)
    kept = [*kept, "score"] if plan.head == "score" else list(kept)  # the head stays as it is trained
    skip = {"llm_int8_skip_modules": kept} if kept else {}
    if plan.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    storage = plan.quant_storage  # FSDP/ZeRO-3 shard flat tensors of one dtype: 4-bit weights packed in it
    kwargs = {"bnb_4bit_quant_storage": torch_dtype(storage)} if storage else {}
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
        **kwargs,
        **skip,
    )


# ---------------------------------------------------------------- safetensors, read piece by piece
def weights_folder(model: ModelSection):
    """The local folder holding the model's config and safetensors weights (fetched from the hub when given an id)."""
    path = Path(model_path(model))
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(
                snapshot_download(
                    model.name, revision=model.revision, allow_patterns=["*.json", "*.safetensors", "*.py", "*.model"]
                )
            )
        except Exception as e:  # offline without a cached copy, unknown id, no access
            raise FtError(
                f"model.name: cannot fetch {model.name!r}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            ) from None
    if not any(path.glob("*.safetensors")):
        bins = sorted(p.name for p in path.glob("*.bin"))
        found = f"it has {', '.join(bins[:3])}" if bins else "it has none"
        raise FtError(
            f"model.name: sharded loading reads safetensors weights, and {path} has no *.safetensors ({found}). "
            "Convert the "
            'weights once: python -c "from transformers import AutoModelForCausalLM as M; '
            "M.from_pretrained('IN').save_pretrained('OUT')\" and point model.name at OUT"
        )
    return path


_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class Checkpoint:
    """The tensors of a safetensors checkpoint (one file, or several listed in model.safetensors.index.json), read a
    row range at a time with plain file reads: nothing is memory-mapped, so a process holds only what it asked for."""

    def __init__(self, folder):
        import json

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = (
                ["model.safetensors"]
                if (folder / "model.safetensors").exists()
                else sorted(p.name for p in folder.glob("*.safetensors"))
            )
        self.entries: dict[str, tuple] = {}
        for name in files:
            self.entries.update(self._header(folder / name))
        self.stacked: dict[str, object] = {}  # fused expert tensors made of per-expert ones (finetune/conversions.py)

    @staticmethod
    def _header(path) -> dict[str, tuple]:
        import json

        import torch

        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            head = json.loads(f.read(size))
        head.pop("__metadata__", None)
        return {
            k: (
                path,
                getattr(torch, _SAFETENSORS_DTYPES[v["dtype"]]),
                tuple(v["shape"]),
                8 + size + v["data_offsets"][0],
            )
            for k, v in head.items()
        }

    def __contains__(self, key: str) -> bool:
        return key in self.entries or key in self.stacked

    def shape(self, key: str) -> tuple:
        return self.stacked[key].shape if key in self.stacked else self.entries[key][2]

    def dtype(self, key: str):
        return self.stacked[key].dtype if key in self.stacked else self.entries[key][1]

    def read(self, key: str, start: int = 0, stop: int | None = None, out=None):
        """Rows [start, stop) of tensor `key` as a CPU tensor in the file's dtype (a scalar reads as one row); into
        `out`
        when given (contiguous, on the CPU, of that dtype and shape)."""
        import math

        import torch

        if key in self.stacked:
            return self.stacked[key].read(self, start, self.shape(key)[0] if stop is None else stop, out)
        path, dtype, shape, offset = self.entries[key]
        rows = shape or (1,)
        stop = rows[0] if stop is None else stop
        buf = torch.empty((stop - start, *rows[1:]), dtype=dtype) if out is None else out
        row_bytes = math.prod(rows[1:]) * buf.element_size()
        view = memoryview(buf.view(-1).view(torch.uint8).numpy())
        with open(path, "rb", buffering=0) as f:
            f.seek(offset + start * row_bytes)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise FtError(
                        f"{path}: the file ends inside tensor {key}; the checkpoint is truncated, download it again"
                    )
                done += n
        return buf


def fill_rows(ckpt: Checkpoint, key: str, start: int, out) -> None:
    """Fill `out` with rows [start, start + len(out)) of checkpoint tensor `key`, in out's dtype; rows past the
    checkpoint's (tokens added since it was saved) get the mean of its rows, as `resize_embeddings` gives them."""
    rows = (ckpt.shape(key) or (1,))[0]
    have = max(0, min(out.shape[0], rows - start))
    if have:
        part = out[:have]
        if part.device.type == "cpu" and part.dtype == ckpt.dtype(key) and part.is_contiguous():
            ckpt.read(key, start, start + have, out=part)  # straight into this rank's shard: no copy at all
        else:  # another dtype, or a GPU shard: one slice staged in host memory, then copied (host-to-device on GPUs)
            part.copy_(ckpt.read(key, start, start + have))
    if have < out.shape[0]:
        chunks = (ckpt.read(key, s, min(s + ROW_CHUNK, rows)).to(out.dtype) for s in range(0, rows, ROW_CHUNK))
        out[have:] = row_mean(chunks).to(out.dtype)


def checkpoint_keys(net, ckpt: Checkpoint) -> dict[int, str]:
    """For each parameter and persistent buffer of `net` (by object id): the checkpoint tensor holding its values. A
    tied tensor (one object, several names) takes whichever of its names the checkpoint has. A new score head (a
    reward model started from a causal LM) has none: it starts from `head_value`."""
    prefix = getattr(net, "base_model_prefix", "")
    keys: dict[int, str] = {}
    state = net.state_dict(keep_vars=True)
    for name, t in state.items():
        for key in (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")):
            if key in ckpt and id(t) not in keys:
                keys[id(t)] = key
    _converted(net, ckpt, state, keys, prefix)
    missing = [name for name, t in state.items() if id(t) not in keys and not is_new_head(name)]
    if missing:
        raise FtError(
            "model.name: the checkpoint has no tensor for "
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} (its layout differs from "
            "the model's in a way ft does not read: a conversion of transformers' other than renamed tensors and "
            "stacked per-expert matrices, finetune/conversions.py); sharded loading needs to find each parameter in "
            "the checkpoint: use distributed.backend: ddp for this model"
        )
    return keys


def _converted(net, ckpt: Checkpoint, state: dict, keys: dict[int, str], prefix: str) -> None:
    """The tensors the checkpoint holds under other names or split per expert (transformers converts them while
    loading: finetune/conversions.py); a fused expert parameter is read from `ckpt` under its own name."""
    from finetune.conversions import sources

    missing = {name: tuple(t.shape) for name, t in state.items() if id(t) not in keys and not is_new_head(name)}
    if not missing:
        return
    for name, source in sources(missing, net, ckpt, prefix).items():
        if not isinstance(source, str):
            ckpt.stacked[name] = source
        keys[id(state[name])] = name if not isinstance(source, str) else source


def init_buffers(net) -> None:
    """Recompute the buffers that are not in checkpoints (rotary frequencies, a vision tower's position ids) after
    `to_empty` left them uninitialised, each with the initialiser of the (sub-)model that holds it (a vision-language
    model's tower is a model of its own: CLIP's initialiser knows CLIP's buffers), as from_pretrained does
    (transformers modeling_utils._initialize_missing_keys); the parameters are marked initialised so that it leaves
    them alone."""
    from transformers import PreTrainedModel

    for p in net.parameters():
        p._is_hf_initialized = True
    models = {name: m for name, m in net.named_modules() if isinstance(m, PreTrainedModel)}
    owners = {name.rpartition(".")[0] for name, _ in net.named_non_persistent_buffers()}
    for name in sorted(owners):
        parts = name.split(".") if name else []
        nearest = next(".".join(parts[:i]) for i in range(len(parts), -1, -1) if ".".join(parts[:i]) in models)
        models[nearest]._init_weights(net.get_submodule(name))


def causal_lm(model):
    """The transformers model inside its data-parallel (DDP, DeepSpeed: `.module`) and peft wrappers."""
    import torch

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model
