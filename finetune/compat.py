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
