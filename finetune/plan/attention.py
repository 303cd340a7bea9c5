"""The attention kernel, and how packed rows keep their samples apart, from what the model class declares.

Unpacked rows run `sdpa` where the class supports it, else `flex_attention` on GPUs (attention sinks, logit
softcapping) where the class supports it and trains without attention dropout, else `eager`. Packed rows take ft's
`sdpa_varlen` (finetune/attention.py: one causal SDPA per sample, sliding windows honoured) where the class supports
SDPA and no chunked-attention layer is shorter than a row; otherwise they carry one mask per layer type
(`Plan.attention_masks`: full, sliding window, chunk), which the collator builds from the sample boundaries
(finetune/data/collate.py) and transformers passes through unchanged. State-space and linear-attention layers keep
samples apart only with their CUDA kernels (`model_class.MIXER_KERNELS`, given each row's `seq_idx`); without them
packing is refused here, with the install line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.hardware import Hardware
from finetune.model_class import ModelClass, for_facts
from finetune.plan.plan import Decision

FIELD = "attn_implementation"


@dataclass(frozen=True)
class Attention:
    """What the planner chose; the Plan's attn_implementation, attention_masks, sample_index and flash_upgrade."""

    kernel: str
    masks: dict = field(default_factory=dict)  # layer type -> {"window": n} | {"chunk": n} | {} (packed, mask path)
    sample_index: bool = False  # packed rows carry seq_idx for the state-space/linear-attention kernels
    flash_upgrade: bool = False  # flash_attention_2 may replace the kernel on a GPU where flash-attn is installed
    padding_free: bool = False  # unpacked rows: a micro-batch's rows are concatenated, each attending to itself


def choose_attention(
    config: Config,
    hw: Hardware,
    mc: ModelClass,
    cp: int,
    out: list[Decision],
    images: bool = False,
    padding_free: bool = True,
) -> Attention:
    """The attention for this model and job; PlanError when the config asks for what the class cannot run. `images`:
    the job trains on images (config/vision_checks.py trains_images); `padding_free`: unpacked rows may be
    concatenated (not where the layers are compiled: the planner asks again without)."""
    packed = config.data.packing
    if packed:
        _check_mixers(mc, hw)
    asked = config.model.attn_implementation
    flat = padding_free and cp == 1 and not images
    choice = _asked(config, hw, mc) if asked != "auto" else _auto(config, hw, mc, out, flat)
    if asked != "auto":
        out.append(Decision(FIELD, asked, "as set in the config", "config"))
    if cp > 1 and choice.kernel != "sdpa":
        raise PlanError(
            f"distributed.context_parallel: {cp} runs torch's ring attention, which replaces SDPA, and {mc.name} runs "
            f"{choice.kernel} here ({_no_sdpa(mc) if not mc.sdpa else 'packed rows'}): set "
            "distributed.context_parallel: 1" + (", or data.packing: false" if packed and mc.sdpa else "")
        )
    return choice


def estimated_kernel(config: Config, hw: Hardware, m) -> str:
    """The kernel the memory and time estimates count for model `m` (catalog.ModelFacts) under `config` on `hw`: what
    `choose_attention` picks, so that a class without SDPA is estimated with eager's T×T scores or flex's block mask.
    Where it refuses the config (the planner says why before it searches), the kernel the config names, or the one
    unpacked rows would take."""
    mc = for_facts(m)
    try:
        return choose_attention(config, hw, mc, 1, []).kernel
    except PlanError:
        asked = config.model.attn_implementation
        return asked if asked != "auto" else unpacked_kernel(mc, hw)[0]


def ring_problem(config: Config, hw: Hardware, m) -> str | None:
    """Why torch's ring attention (context parallelism), which replaces SDPA, cannot run model `m`'s attention here
    with model.attn_implementation auto (None: it can). plan/parallel.py refuses an explicit degree with it and never
    tries one automatically."""
    mc = for_facts(m)
    if config.model.attn_implementation != "auto" or mc.sdpa:
        return None
    kernel, _ = unpacked_kernel(mc, hw)
    return f"{_no_sdpa(mc)}, the only attention torch's ring attention replaces (ft runs {kernel} for it here)"


def _auto(config: Config, hw: Hardware, mc: ModelClass, out: list[Decision], flat: bool = False) -> Attention:
    kernel, why = unpacked_kernel(mc, hw)
    upgrade = mc.flash and not hw.is_cpu  # flash-attention 2 takes sliding windows, softcapping and varlen rows
    later = " (flash-attention 2 instead where it is installed)" if upgrade else ""
    if not config.data.packing:
        if flat and padding_free_allowed(config, mc):
            out.append(
                Decision(
                    FIELD,
                    "sdpa_varlen",
                    "unpacked rows, padding-free: a micro-batch's rows are concatenated into one row and ft's "
                    "sdpa_varlen runs one causal attention per row, so no compute goes to padding and rows never see "
                    f"each other (the loss sums over tokens, whatever row they sit in){later}",
                )
            )
            return Attention("sdpa_varlen", flash_upgrade=upgrade, padding_free=True)
        out.append(Decision(FIELD, kernel, why + later))
        return Attention(kernel, flash_upgrade=upgrade)
    if mc.mixers:
        out.append(Decision(FIELD, "sdpa_varlen", _mixer_reason(mc) + later))
        return Attention("sdpa_varlen", sample_index=True, flash_upgrade=upgrade)
    problem = varlen_problem(mc, config.data.seq_len)
    if problem is None:
        window = f" (its {mc.sliding_window}-token sliding window honoured)" if mc.sliding_window else ""
        out.append(
            Decision(
                FIELD,
                "sdpa_varlen",
                f"packed rows: ft's padding-free SDPA runs one causal attention per sample{window}, so samples never "
                f"see each other and no T×T mask is built{later}",
            )
        )
        return Attention("sdpa_varlen", flash_upgrade=upgrade)
    masks = mask_kinds(mc, config.data.seq_len)
    if mc.sdpa:
        out.append(Decision(FIELD, "sdpa", f"{problem}: SDPA with masks; packed rows: {_mask_text(masks)}{later}"))
        return Attention("sdpa", masks=masks, flash_upgrade=upgrade)
    why = f"{problem}: transformers' eager attention with masks, as the model class runs them"
    out.append(Decision(FIELD, "eager", f"{why}; packed rows: {_mask_text(masks)}{later}"))
    return Attention("eager", masks=masks, flash_upgrade=upgrade)


def varlen_fast(hw: Hardware, precision: str) -> bool:
    """Whether concatenated rows run at least as fast as padded ones here: on CPUs (one causal SDPA per sample, measured
    faster than a padded batch: no compute on padding), and on GPUs where torch's varlen kernel takes the call
    (finetune/attention.py uses_kernel: NVIDIA sm80+, fp16/bf16). Elsewhere a GPU would run one SDPA call per sample
    instead of one per batch: rows stay padded."""
    acc = hw.accelerator
    if acc is None:
        return True
    return acc.vendor == "nvidia" and (acc.compute_capability or (0, 0)) >= (8, 0) and precision in ("bf16", "fp16")


def padding_free_allowed(config: Config, mc: ModelClass) -> bool:
    """Whether unpacked rows may run padding-free (Attention.padding_free): a loss summed over tokens (SFT: a
    preference or reward method reads its rows as pairs or sequences), and a class that runs sdpa_varlen exactly with
    no state-space or linear-attention layers (their kernels need seq_idx)."""
    return config.method.summed_loss and not mc.mixers and varlen_problem(mc, config.data.seq_len) is None


def unpacked_kernel(mc: ModelClass, hw: Hardware) -> tuple[str, str]:
    """The kernel for unpacked rows, and why."""
    if mc.sdpa:
        declared = f"{mc.name} supports it" if mc.declared else f"assumed for {mc.model_type}, which transformers lacks"
        return "sdpa", f"torch's scaled-dot-product attention ({declared}): memory-efficient kernels, no extra install"
    if mc.flex and not hw.is_cpu and not mc.attention_dropout:
        return "flex_attention", f"{_no_sdpa(mc)}; torch's flex_attention fuses it on the GPU"
    flex = (
        "flex_attention cannot run attention sinks on CPU"
        if mc.flex and mc.sinks and hw.is_cpu
        else "flex_attention does not train with attention dropout"
        if mc.flex and mc.attention_dropout
        else "flex_attention is compiled for GPUs"
        if mc.flex
        else "nor flex_attention"
    )
    return "eager", f"{_no_sdpa(mc)} and {flex}: transformers' eager attention"


def varlen_problem(mc: ModelClass, seq_len: int) -> str | None:
    """Why sdpa_varlen cannot run this model's packed rows exactly (None: it can)."""
    if not mc.sdpa:
        return _no_sdpa(mc)
    if mc.chunk_size and mc.chunk_size < seq_len:
        return (
            f"{mc.name} attends in chunks of {mc.chunk_size} tokens, shorter than data.seq_len {seq_len}, which "
            "sdpa_varlen does not see"
        )
    return None


def mask_kinds(mc: ModelClass, seq_len: int) -> dict:
    """Per attention layer type, the mask a packed row needs: {} full causal, {"window": n}, {"chunk": n}. A window
    or chunk no shorter than a row is full attention. Empty when one full causal mask serves every layer."""
    kinds = {}
    for kind in mc.attention_kinds or ("full_attention",):
        if kind == "sliding_attention" and mc.sliding_window and mc.sliding_window < seq_len:
            kinds[kind] = {"window": mc.sliding_window}
        elif kind == "chunked_attention" and mc.chunk_size and mc.chunk_size < seq_len:
            kinds[kind] = {"chunk": mc.chunk_size}
        else:
            kinds[kind] = {}
    distinct = {tuple(v.items()) for v in kinds.values()}
    if len(distinct) == 1:
        only = next(iter(kinds.items()))
        return {} if not only[1] else dict([only])
    return kinds


def _mask_text(masks: dict) -> str:
    if not masks:
        return "one mask keeps each sample to itself"
    parts = [f"{kind}: {_spec_text(spec)}" for kind, spec in masks.items()]
    return f"one mask per layer type ({', '.join(parts)}) keeps each sample to itself"


def _spec_text(spec: dict) -> str:
    if "window" in spec:
        return f"{spec['window']}-token sliding window"
    if "chunk" in spec:
        return f"chunks of {spec['chunk']} tokens"
    return "full causal"


def _no_sdpa(mc: ModelClass) -> str:
    why = "attention sinks" if mc.sinks else "its class declares _supports_sdpa = False"
    return f"{mc.name} does not support SDPA ({why})"


def _mixer_reason(mc: ModelClass) -> str:
    kinds = ", ".join(mc.mixers)
    return (
        f"packed rows: ft's padding-free SDPA per sample in the attention layers, and each row's sample index for the "
        f"{kinds} layers' kernels ({', '.join(p for p, _ in _pips(mc))}), which keep samples apart"
    )


def _pips(mc: ModelClass) -> list[tuple[str, str]]:
    from finetune.model_class import MIXER_KERNELS

    return [(pip, module) for kind in mc.mixers for module, pip in MIXER_KERNELS.get(kind, ())]


def _check_mixers(mc: ModelClass, hw: Hardware) -> None:
    """Packing with state-space or linear-attention layers: only with the kernels that keep samples apart, on GPUs."""
    unknown = "linear_attention" in mc.layer_types and not mc.mixers
    if not mc.mixers and not unknown:
        return
    head = f"data.packing: {mc.name} has {', '.join(mc.mixers) or 'linear-attention'} layers"
    if unknown:
        raise PlanError(
            f"{head}, and ft knows no kernel that keeps packed samples apart there: set data.packing: false"
        )
    missing = mc.missing_kernels()
    pips = " ".join(dict.fromkeys(p for p, _ in _pips(mc)))
    leak = "their PyTorch path lets each packed sample see the samples before it"
    if hw.is_cpu:
        raise PlanError(
            f"{head}: on CPU {leak}, and the kernels that keep samples apart are CUDA packages: set data.packing: "
            f"false, or train on GPUs with `pip install {pips}`"
        )
    if missing:
        raise PlanError(
            f"{head}: without {', '.join(missing)} {leak}: `pip install {' '.join(missing)}` on the GPU machines "
            "(a CUDA build), or set data.packing: false"
        )


def _asked(config: Config, hw: Hardware, mc: ModelClass) -> Attention:
    """The kernel the config names, checked against the class, the hardware and packing."""
    asked, packed, key = config.model.attn_implementation, config.data.packing, f"model.{FIELD}: "
    if asked in ("sdpa", "sdpa_varlen") and not mc.sdpa:
        alt = unpacked_kernel(mc, hw)[0]
        raise PlanError(f"{key}{asked}: {_no_sdpa(mc)}; set it to auto (ft picks {alt} here) or eager")
    if asked == "flash_attention_2" and (hw.is_cpu or not mc.flash):
        why = "it needs a CUDA GPU" if hw.is_cpu else f"{mc.name} does not support flash-attention 2"
        raise PlanError(f"{key}flash_attention_2: {why}; set it to auto")
    if packed and mc.mixers and asked not in ("sdpa_varlen", "flash_attention_2"):
        raise PlanError(
            f"{key}{asked}: packed rows through {mc.name}'s {', '.join(mc.mixers)} layers need sample boundaries "
            "(the varlen path); set it to auto or sdpa_varlen, or data.packing: false"
        )
    if packed and asked == "sdpa_varlen" and (problem := varlen_problem(mc, config.data.seq_len)):
        raise PlanError(f"{key}sdpa_varlen: {problem}; set it to auto (masks per layer type) or sdpa")
    if not packed or asked in ("sdpa_varlen", "flash_attention_2"):
        return Attention(asked, sample_index=packed and bool(mc.mixers))
    return Attention(asked, masks=mask_kinds(mc, config.data.seq_len))
