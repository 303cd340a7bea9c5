"""ZeRO-3 models built partitioned, so that no rank ever holds the whole model.

transformers (5.24) constructs a model inside `deepspeed.zero.Init` whenever an `HfDeepSpeedConfig` of stage 3 is
alive (modeling_utils `_from_config`, `get_init_context`): every module's parameters are split over the ranks as soon
as the module exists. Its `from_pretrained` then fills them from a state dict of the *whole* checkpoint that rank 0
reads first (modeling_utils `_load_pretrained_model`: `map_location="cpu"` on rank 0, "meta" elsewhere), so rank 0
peaks at the whole model plus its partition (measured, 400M parameters on two CPU ranks: 1.8x the bf16 size).

Here the model is constructed the same way (inside `zero.Init`, the embeddings already at the tokenizer's size,
without the random initialisation), then filled module by module: the module's parameters are gathered, rank 0 reads
just their tensors from the safetensors files (plain reads, `models.Checkpoint`), and `GatheredParameters
(modifier_rank=0)` broadcasts them and partitions them again on exit. Each rank peaks at its partition plus one module
(measured as above: 0.55x per rank). Adapters are created whole (they are small), given their seeded starting values
(`adapters.init_adapter`), then partitioned like the rest.
"""

from __future__ import annotations

import contextlib

import torch

from finetune.errors import FtError

_live: dict = {}  # the HfDeepSpeedConfig that transformers and peft see through a weak reference: kept for the process


@contextlib.contextmanager
def zero3_withdrawn():
    """While a model that ZeRO-3 must not partition is built (a GRPO reward model, whole on every rank): transformers'
    from_pretrained constructs under zero.Init whenever the ZeRO-3 announcement is live (is_deepspeed_zero3_enabled),
    so it is withdrawn meanwhile and restored after."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if "config" in _live:
            set_hf_deepspeed_config(_live["config"])


def zero_dtype(config: dict) -> torch.dtype:
    """The dtype ZeRO-3 keeps parameters in: fp16 or bf16 when enabled, else fp32 (deepspeed zero.Init._set_dtype)."""
    if config.get("fp16", {}).get("enabled") is True:
        return torch.float16
    return torch.bfloat16 if config.get("bf16", {}).get("enabled") is True else torch.float32


def partitioned_model(model_section, adapter_section, plan, tokenizer, attn: str, device, seed: int, config: dict):
    """The model to train, adapter applied and every parameter partitioned over the ranks (`config`: the job's DeepSpeed
    configuration, stage 3). deepspeed.initialize then finds nothing left to partition."""
    from finetune.adapters import apply_adapter, init_adapter

    with _host_memory_returned(device):
        base = partitioned_base(model_section, plan, tokenizer, attn, config, seed)
        model = apply_adapter(base, adapter_section, plan)
        if plan.adapter != "full":
            init_adapter(model, seed)  # lora_A/lora_B are whole here: the same seeded values as in one process
        _partition_the_rest(model, config)
    return model


def partitioned_base(model_section, plan, tokenizer, attn: str, config: dict, seed: int = 0):
    """The pretrained model, constructed partitioned and filled from its safetensors module by module; embeddings grown
    to the tokenizer (new rows: the mean of the old ones, as models.resize_embeddings gives them); checkpointing on."""
    import deepspeed
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    from finetune import models

    # DeepSpeed's view of the process group ft started; GPU: that group sends cuda tensors over NCCL (runtime.backend)
    deepspeed.init_distributed(dist_init_required=False)
    folder = models.weights_folder(model_section)
    hf_config = AutoConfig.from_pretrained(
        str(folder), trust_remote_code=model_section.trust_remote_code, **models.head_options(plan, tokenizer)
    )
    text = hf_config.get_text_config()
    grown = tokenizer is not None and len(tokenizer) > text.vocab_size
    if grown:
        # constructed at the new size: no whole-table copy as resize_token_embeddings makes
        text.vocab_size = len(tokenizer)
    models.register_attention(attn)
    kwargs = {
        "dtype": zero_dtype(config),
        "attn_implementation": attn,
        "trust_remote_code": model_section.trust_remote_code,
    }
    net = construct(models.auto_class(plan), hf_config, kwargs, config)
    # tell transformers and peft that parameters are ZeRO-3 partitioned, for the rest of the process: models are then
    # constructed partitioned, and their ZeRO-3 code paths gather what they touch (resizing, DoRA norms, generate's
    # default synced_gpus)
    _live["config"] = HfDeepSpeedConfig(config)
    ckpt = models.Checkpoint(folder)
    try:
        keys = models.checkpoint_keys(net, ckpt)
    except FtError:  # tensors transformers renames or fuses while loading (e.g. MoE experts): its own ZeRO-3 loader
        if grown:
            raise FtError(
                f"model.name: {model_section.name} has a checkpoint layout that transformers converts while loading, "
                "which ZeRO-3 then reads whole on rank 0, and tokens were added: that combination is not supported; "
                "add no tokens, or use distributed.sharding: zero2"
            ) from None
        del net
        # rank 0 reads the whole checkpoint (see module doc)
        net, info = models.auto_class(plan).from_pretrained(
            str(folder), output_loading_info=True, **kwargs, **models.head_options(plan, tokenizer)
        )
        models.init_head(net, [k for k in info.get("missing_keys", ()) if models.is_new_head(k)], seed)
    else:
        fill(net, ckpt, keys, seed)
    return models.finish_model(net, plan)


def construct(auto_class, hf_config, kwargs: dict, config: dict):
    """The model's modules with parameters partitioned as each module is created, values not initialised (they are
    read next): what transformers' from_config does under an HfDeepSpeedConfig (modeling_utils._from_config), without
    the initialisation pass it then runs over every gathered module (a third of the loading time on CPU, then
    overwritten). The ZeRO-3 announcement is withdrawn meanwhile, or from_config would add that pass."""
    import deepspeed
    from transformers.initialization import no_init_weights
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    with zero3_withdrawn():
        # Built once on the meta device first, so that every class it takes is defined before zero.Init: a module class
        # defined inside it gets back, when it exits, the __init__ it had when its class statement ran (deepspeed 0.19
        # partition_parameters `_init_subclass`, `_disable_class`), without what a class decorator set after that: the
        # next model of the class (a DPO reference) then lacks the kernel table of transformers 5.25's kernel-hub
        # attention (kernels 0.19 `use_kernelized_func`) and fails at its first forward
        with torch.device("meta"), no_init_weights():
            auto_class.from_config(hf_config, **kwargs)
        # prevent_arange_dtype_change before zero.Init: rotary frequencies keep their fp32 arange (its docstring)
        # GPU: zero.Init puts partitions on cuda:LOCAL_RANK, or in host RAM with offload_param
        # (partition_parameters.Init)
        with (
            no_init_weights(),
            prevent_arange_dtype_change(),
            deepspeed.zero.Init(config_dict_or_path=config, dtype=kwargs["dtype"]),
        ):
            net = auto_class.from_config(hf_config, **kwargs)
    net.tie_weights()  # from_config ties in init_weights, which no_init_weights skips
    return net


def fill(net, ckpt, keys: dict, seed: int = 0) -> None:
    """Copy the checkpoint into the partitioned parameters, one module at a time (gathered, written by rank 0, then
    broadcast and partitioned again); persistent buffers (never partitioned) are read by every rank. `keys`: the
    checkpoint tensor of each parameter and buffer, by object id (models.checkpoint_keys)."""
    import deepspeed

    from finetune import models

    writer = torch.distributed.get_rank() == 0
    seen: set[int] = set()
    with torch.no_grad():
        for prefix, module in net.named_modules():
            named = [(f"{prefix}.{n}", p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in named)
            if named:
                with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0):
                    if writer:  # GPU: gathered on this rank's device; fill_rows stages slices in host memory
                        for name, p in named:
                            if id(p) in keys:
                                models.fill_rows(ckpt, keys[id(p)], 0, p.data)
                            else:  # a new score head (models.checkpoint_keys)
                                std = models.head_std(net)
                                p.data.copy_(models.head_value(name, tuple(p.shape), seed, std).to(p.dtype))
            for b in module.buffers(recurse=False):
                if id(b) in keys and id(b) not in seen:
                    seen.add(id(b))
                    models.fill_rows(ckpt, keys[id(b)], 0, b.data)


def _partition_the_rest(model, config: dict) -> None:
    """Partition what was created after construction (adapter weights, peft's trained copies of whole modules), in
    ZeRO-3's dtype: the cast deepspeed.initialize gives a model it partitions itself
    (engine._cast_module_mixed_precision) and skips for a model that zero.Init built."""
    import deepspeed

    dtype = zero_dtype(config)
    whole = [p for p in model.parameters() if not hasattr(p, "ds_id")]
    for p in whole:
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    # GPU: peft placed them on the base layers' device; Init(module=) moves each to cuda:LOCAL_RANK, broadcasts, splits
    if whole:
        deepspeed.zero.Init(module=model, config_dict_or_path=config)  # partitions the parameters not yet partitioned


def partitioned_reference(model_section, plan, tokenizer, attn: str, device, config: dict):
    """A frozen copy of the starting model, partitioned like the policy, under its own DeepSpeed engine without an
    optimizer (deepspeed 0.19 engine: ZeRO-3 without an optimizer sets up DeepSpeedZeRoOffload, the parameter-gathering
    hooks alone, on every submodule). Returned is the module itself: its hooks gather each layer in forward, as the
    engine's forward does by calling it (engine.forward adds only DeepCompile and torch_autocast, unused here). Its
    forward is a collective: every rank calls it the same number of times, as for the policy."""
    import deepspeed

    config = inference_config(config)
    with _host_memory_returned(device):
        net = partitioned_base(model_section, plan, tokenizer, attn, config)
    net.requires_grad_(False).eval()
    engine, _, _, _ = deepspeed.initialize(model=net, config=config, dist_init_required=False)
    net.__dict__["_ft_zero3_engine"] = engine  # kept as long as the model, not registered as its submodule
    return net.eval()


def inference_config(config: dict) -> dict:
    """The job's DeepSpeed configuration for a model that is never trained: no optimizer, so no optimizer offload."""
    zero = {k: v for k, v in config.get("zero_optimization", {}).items() if k != "offload_optimizer"}
    return {**config, "zero_optimization": zero}


@contextlib.contextmanager
def _host_memory_returned(device):
    """On CPU ranks, while a model is built: buffers freed after partitioning go back to the system (see
    finetune/distributed/hostmem.py; measured, 400M parameters on two ranks: 0.9x and 1.15x the bf16 size per rank
    instead of 0.55x without it). GPU ranks keep partitions in device memory, so nothing changes for them."""
    if device is None or torch.device(device).type == "cpu":
        from finetune.distributed.hostmem import return_freed_memory

        return_freed_memory()
    yield
