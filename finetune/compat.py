"""The one place where ft adjusts a library's behaviour it cannot otherwise avoid; each adjustment names the
versions it was read in, checks that what it changes still exists, and has a test (tests/test_compat.py)."""

from __future__ import annotations


def keep_4bit_layers_trainable_on_cpu(model) -> int:
    """bitsandbytes 0.50 (nn/modules.py, Linear4bit.forward): on CPUs with AVX512-BF16, the first forward in eval mode
    without gradients repacks the 4-bit weight in place for an inference-only kernel and marks its quant state as
    repacked. ft evaluates and trains the same model (validation, DPO references, GRPO rollouts), and after that
    first eval forward the training forwards run through the inference kernel: no gradient reaches the inputs of
    the 4-bit layers, and a sharded copy (FSDP2, ZeRO-3) drops the repacked data at reshard while the state still
    says repacked. Each layer's `support_avx512bf16_for_cpu` (an attribute bitsandbytes sets per layer from a CPU
    probe) is turned off, so CPUs run the same kernels as training; GPUs never take that path. Returns the number
    of layers changed (0 where bitsandbytes or the attribute is absent)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    layers = [
        m for m in model.modules() if isinstance(m, Linear4bit) and getattr(m, "support_avx512bf16_for_cpu", False)
    ]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


BNB_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNEL_WARNING = "Failed to load CPU gemm_4bit_forward from kernels-community"
BNB_KERNEL_REPO = "kernels-community/quantization-bitsandbytes"
# kernels 0.19 (_internals/hf_hub.py _check_trust_remote_code), which transformers 5.25 installs: offline, the fetch
# above first logs that it skips the publisher check of that repository
KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"
KERNELS_OFFLINE_NOTICE = "Skipping publisher trust check for"


class _DropUnusedKernelWarning:
    """A logging filter: drops bitsandbytes' notice that its CPU inference kernel could not be fetched, and the
    `kernels` package's offline notice about that same kernel's repository (its notices of other kernels pass)."""

    def filter(self, record) -> bool:
        msg = str(record.msg)
        if record.name == KERNELS_HUB_LOGGER:
            return not (msg.startswith(KERNELS_OFFLINE_NOTICE) and f"'{BNB_KERNEL_REPO}'" in msg)
        return not msg.startswith(BNB_KERNEL_WARNING)


def quiet_unused_bitsandbytes_kernel() -> None:
    """bitsandbytes 0.50 (backends/cpu/ops.py), on CPUs with AVX512-BF16, tries at import to fetch an inference-only
    4-bit kernel from the hub and logs a warning when it cannot (always, offline or without the `kernels` package;
    offline with it, `kernels` also logs that it skips the repository's publisher check).
    ft never runs that kernel (keep_4bit_layers_trainable_on_cpu turns its path off), so these notices, printed by
    every run, are noise: a filter on those two loggers drops exactly them; every other message passes."""
    import logging

    for name in (BNB_KERNEL_LOGGER, KERNELS_HUB_LOGGER):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropUnusedKernelWarning) for f in logger.filters):
            logger.addFilter(_DropUnusedKernelWarning())


def ddp_buckets_rebuilt(model) -> bool:
    """Whether DDP has rebuilt its buckets in the order the backward pass produced gradients (torch 2.13
    nn/parallel/distributed.py: `_pre_forward` sets `_has_rebuilt_buckets` once the Reducer has rebuilt them, at the
    second step). Torch has no public name for it; ft reads the attribute here only, and tests/test_compat.py fails
    the day torch renames it (before it is set, ft's DDP frees gradients each step instead of zeroing them in place:
    the same maths, more all-reduces)."""
    return bool(getattr(model, "_has_rebuilt_buckets", False))
