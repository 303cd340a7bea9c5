"""What a mixture-of-experts model is made of, as its class declares it, and what a LoRA adapter adapts there.

- Routers: the modules whose logits transformers records as `router_logits` (the model class's
  `_can_record_outputs`, an OutputRecorder naming the router class and where its logits are in its output).
- Routed experts: fused 3-D parameters (experts × out × in, or × in × out) in transformers 5, not nn.Linear layers;
  peft adapts them through `target_parameters` (lora.ParamWrapper).
- Gates: a 1-wide nn.Linear directly inside the block that holds the experts (Qwen3-Next's `shared_expert_gate`, a
  sigmoid gate on the shared expert's output); routers (with the linear layers inside them: Gemma 4's `router.proj`)
  and gates decide where tokens go and are not adapted. Other linear layers of that block are adapted as usual
  (Gemma 4's experts sit in the decoder layer itself, beside its per-layer input projections).
- How many experts a router chooses from, and how many per token: as the router or the model's config declares them
  (`expert_count`, `experts_per_token`); routers differ (Gemma 4's has no weight of its own, only its config).
- Shared experts and dense MLP layers are nn.Linear layers like the attention projections.

peft rewrites the targets of MoE families whose checkpoints transformers 5 converts (Mixtral, Qwen3-MoE,
Qwen3-Next, DeepSeek-V3, GLM-4-MoE, ...). peft 0.21 turns a target module named gate_proj, up_proj or down_proj into
the fused expert parameter of that name, so the dense MLPs and shared experts would silently lose their adapter (peft
issue 3711), and `all-linear` adds the router's weight; peft 0.22 keeps a target that names only linear layers.
`adapter_targets` asks the installed peft's own conversion which linear layers it would drop and adapts their weights
through `target_parameters` instead, so that every intended layer is adapted whichever peft is installed (with 0.22,
none is dropped, and under a 4/8-bit base those layers are quantized like the attention projections).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Targets:
    """What a LoRA adapter adapts in one model: peft's target_modules and target_parameters, as full names."""

    modules: tuple[str, ...]  # nn.Linear layers (lora.Linear, or lora.Linear4bit over a quantized base)
    parameters: tuple[str, ...]  # weights adapted through lora.ParamWrapper: fused experts (3-D), and see module text


def router_spec(lm) -> tuple[type | None, str | None, int] | None:
    """(router class, or its class name, index of the logits in its output) as the model class declares it; None for
    a model without routers."""
    for module in lm.modules():
        recorder = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if isinstance(recorder, type):  # a class alone: its output is the logits
            return recorder, None, 0
        if recorder is not None and not isinstance(recorder, str):  # an OutputRecorder
            return recorder.target_class, recorder.class_name, recorder.index
    return None


def routers(lm) -> list[tuple[str, torch.nn.Module]]:
    """The router modules, by name, in the model's order (one per MoE layer)."""
    spec = router_spec(lm)
    if spec is None:
        return []
    cls, class_name, _ = spec
    return [
        (name, m)
        for name, m in lm.named_modules()
        if (cls is not None and isinstance(m, cls)) or (cls is None and type(m).__name__.endswith(class_name or "?"))
    ]


COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")  # how routers and configs name the expert count
TOP_K_KEYS = ("top_k", "num_experts_per_tok", "top_k_experts")  # and the experts each token goes to


def _declared(sources, keys: tuple[str, ...]) -> int:
    """The first positive integer that one of `sources` declares under one of `keys` (0: none does)."""
    for source in sources:
        for key in keys:
            value = getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def _text_config(lm):
    config = getattr(lm, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def expert_count(router, config=None) -> int:
    """How many experts `router` chooses from: its own num_experts, else its weight's rows (the global shape, also of
    an FSDP2 shard or a ZeRO-3 partition), else what its config or the model's (`config`) declares (Gemma 4's router
    holds only a config and an inner projection). 0 where nothing declares it."""
    own = _declared((router,), COUNT_KEYS)
    weight = getattr(router, "weight", None)
    shape = tuple(getattr(weight, "ds_shape", getattr(weight, "shape", ())))  # a ZeRO-3 partition: its full shape
    if not own and isinstance(weight, torch.Tensor) and len(shape) == 2:
        own = int(shape[0])
    return own or _declared((getattr(router, "config", None), config), COUNT_KEYS)


def experts_per_token(router, config=None) -> int:
    """How many experts `router` sends each token to, as it, its config or the model's declares it (1 otherwise)."""
    return _declared((router, getattr(router, "config", None), config), TOP_K_KEYS) or 1


def _inside(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def expert_parameters(lm) -> list[str]:
    """Full names of the fused routed-expert weights: the 3-D floating-point parameters, one slice per expert
    (as many as a router has outputs), outside routers, convolutions (a depthwise conv1d weight is 3-D too) and a
    vision-language model's vision side (SigLIP's pooling head holds a 3-D probe)."""
    from finetune.vision import vision_names

    found = routers(lm)
    experts = {expert_count(m, _text_config(lm)) for _, m in found} - {0}
    skip = [name for name, _ in found] + vision_names(lm)
    out = []
    for module_name, module in lm.named_modules():
        if _inside(module_name, skip) or isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            continue
        for name, p in module.named_parameters(recurse=False):
            shape = tuple(getattr(p, "ds_shape", p.shape))  # a ZeRO-3 partition holds its full shape apart
            if len(shape) == 3 and p.is_floating_point() and (not experts or shape[0] in experts):
                out.append(f"{module_name}.{name}")
    return out


def is_moe(lm) -> bool:
    return bool(routers(lm)) or bool(expert_parameters(lm))


def gates(lm) -> list[str]:
    """The routers and the gates beside the experts (1-wide linear layers directly inside a block holding experts)."""
    experts = {name.rsplit(".", 2)[0] for name in expert_parameters(lm)}  # the MoE blocks: parents of experts modules
    out = [name for name, _ in routers(lm)]
    for block in experts:
        for child, m in lm.get_submodule(block).named_children() if block else ():
            if isinstance(m, torch.nn.Linear) and m.out_features == 1:
                out.append(f"{block}.{child}")
    return sorted(set(out))


def _named(names: list[str], wanted) -> list[str]:
    """`names` selected by `wanted` as peft selects target modules: all (all-linear), or each name that equals one
    of the wanted names or ends with ".<wanted>"."""
    if wanted == ALL_LINEAR:
        return list(names)
    return [n for n in names if any(n == w or n.endswith(f".{w}") for w in wanted)]


def adapter_targets(lm, wanted, trained_in_full: tuple[str, ...] = ()) -> Targets:
    """The targets of `wanted` (`all-linear` or a list of names) in an MoE model: the linear layers (attention,
    dense MLPs, shared experts; never the output head, the modules `trained_in_full` (modules_to_save), routers or
    gates) and the fused experts (all of them for all-linear; for a list, those it names, or all where it names the
    experts module)."""
    left_out = gates(lm)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    linear = [
        name
        for name, m in lm.named_modules()
        if isinstance(m, torch.nn.Linear)
        and m is not head
        and not _inside(name, left_out)
        and name.rsplit(".", 1)[-1] not in trained_in_full
    ]
    linear = _named(linear, wanted)
    experts = expert_parameters(lm)
    if wanted != ALL_LINEAR:
        experts = [e for e in experts if any(e.endswith(f".{w}") or f".{w}." in e for w in wanted)]
    dropped = _dropped_by_peft(lm, linear)
    modules = tuple(n for n in linear if n not in dropped)
    return Targets(modules, tuple(experts) + tuple(f"{n}.weight" for n in linear if n in dropped))


def _dropped_by_peft(lm, linear: list[str]) -> set[str]:
    """The linear layers that peft's conversion of targets for transformers 5 MoE checkpoints would take out of
    target_modules (see the module text), found by running that conversion on a trial config."""
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    if not linear:
        return set()
    trial = LoraConfig(target_modules=list(linear))
    convert_peft_config_for_transformers(trial, lm, None)
    kept = set(trial.target_modules or ())
    return {name for name in linear if name not in kept}


def unquantized_names(lm, wanted, trained_in_full: tuple[str, ...] = ()) -> list[str]:
    """Linear layers that must keep their 16-bit weights under a 4/8-bit base: those adapted through
    target_parameters (lora.ParamWrapper adapts a plain weight; bitsandbytes' packed weights are not one)."""
    targets = adapter_targets(lm, wanted, trained_in_full)
    return [p.rsplit(".", 1)[0] for p in targets.parameters if p.endswith(".weight")]


def kept_unquantized(folder: str, trust_remote_code: bool, auto_class, revision: str = "main") -> list[str]:
    """For a 4/8-bit base of an MoE model: what bitsandbytes must leave as it is, as exact-name patterns for
    BitsAndBytesConfig.llm_int8_skip_modules: transformers' own defaults (get_keys_to_not_convert: the output head,
    tied and last weights) and the linear layers an adapter reaches only through target_parameters. [] for a dense
    model (transformers' defaults apply). Reads the model's structure from its config on the meta device."""
    import re

    from transformers import AutoConfig
    from transformers.quantizers.base import get_keys_to_not_convert

    try:
        config = AutoConfig.from_pretrained(folder, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):  # from_pretrained, which reads it next, says why
        return []
    with torch.device("meta"):
        lm = auto_class.from_config(config, trust_remote_code=trust_remote_code)
    if not is_moe(lm):
        return []
    names = get_keys_to_not_convert(lm) + unquantized_names(lm, ALL_LINEAR)
    return [re.escape(n) for n in dict.fromkeys(names)]
