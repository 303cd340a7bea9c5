"""finetune/compat.py: what each adjustment changes still exists in the installed library, and it takes effect."""

from __future__ import annotations

import pytest
import torch


def test_4bit_layers_keep_their_training_kernels_after_an_eval_forward():
    bnb = pytest.importorskip("bitsandbytes")
    from finetune.compat import keep_4bit_layers_trainable_on_cpu

    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    layer.load_state_dict({"weight": torch.randn(64, 64)})
    layer = layer.to("cpu")
    assert hasattr(layer, "support_avx512bf16_for_cpu")  # the attribute bitsandbytes 0.50 reads; gone: revisit compat
    layer.support_avx512bf16_for_cpu = True  # as on a CPU with AVX512-BF16
    model = torch.nn.Sequential(layer)
    assert keep_4bit_layers_trainable_on_cpu(model) == 1
    before = layer.weight.data.clone()
    with torch.no_grad():
        model.eval()(torch.randn(2, 64, dtype=torch.bfloat16))
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    assert torch.equal(layer.weight.data, before)  # not repacked in place
    x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
    model.train()(x).float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0  # gradients flow through the 4-bit base
    assert keep_4bit_layers_trainable_on_cpu(torch.nn.Linear(2, 2)) == 0


def test_the_unused_bitsandbytes_kernel_warning_is_dropped_and_nothing_else(caplog):
    import inspect
    import logging

    pytest.importorskip("bitsandbytes")
    import bitsandbytes.backends.cpu.ops as ops

    from finetune.compat import BNB_KERNEL_LOGGER, BNB_KERNEL_WARNING

    assert ops.__name__ == BNB_KERNEL_LOGGER  # the logger bitsandbytes warns through; renamed: revisit compat
    assert BNB_KERNEL_WARNING in inspect.getsource(ops)  # the message ft drops still exists
    logger = logging.getLogger(BNB_KERNEL_LOGGER)
    with caplog.at_level(logging.WARNING, logger=BNB_KERNEL_LOGGER):
        logger.warning(BNB_KERNEL_WARNING + ": %s. Please make sure ...", "no network")
        logger.warning("some other bitsandbytes warning")
    messages = [r.getMessage() for r in caplog.records if r.name == BNB_KERNEL_LOGGER]
    assert messages == ["some other bitsandbytes warning"]


def test_the_offline_notice_about_bitsandbytes_unused_kernel_is_dropped_and_no_other_kernels_notice(caplog):
    """Offline, the `kernels` package that transformers installs first notes that it skips the publisher check of the
    repository bitsandbytes fetches its CPU kernel from: dropped; the same notice for another repository passes."""
    import inspect
    import logging

    hf_hub = pytest.importorskip("kernels._internals.hf_hub")
    ops = pytest.importorskip("bitsandbytes.backends.cpu.ops")

    from finetune.compat import BNB_KERNEL_REPO, KERNELS_HUB_LOGGER, KERNELS_OFFLINE_NOTICE

    assert hf_hub.logger.name == KERNELS_HUB_LOGGER  # renamed: revisit compat
    assert KERNELS_OFFLINE_NOTICE in inspect.getsource(hf_hub)
    assert f'"{BNB_KERNEL_REPO}"' in inspect.getsource(ops)  # the repository bitsandbytes fetches from
    with caplog.at_level(logging.WARNING, logger=KERNELS_HUB_LOGGER):
        for repo in (BNB_KERNEL_REPO, "kernels-community/flash-attn2"):
            hf_hub.logger.warning(f"{KERNELS_OFFLINE_NOTICE} '{repo}' because Hugging Face Hub is in offline mode.")
    messages = [r.getMessage() for r in caplog.records if r.name == KERNELS_HUB_LOGGER]
    assert messages == [
        f"{KERNELS_OFFLINE_NOTICE} 'kernels-community/flash-attn2' because Hugging Face Hub is in offline mode."
    ]


@pytest.mark.own_process  # a process group in-process: not in a pytest worker shared with later tests
def test_ddp_says_when_its_buckets_are_rebuilt():
    """The attribute compat.ddp_buckets_rebuilt reads: False before DDP's second forward, True after it."""
    from torch.nn.parallel import DistributedDataParallel

    from finetune.compat import ddp_buckets_rebuilt
    from tests.helpers import in_a_one_rank_group

    def check():
        model = DistributedDataParallel(torch.nn.Linear(4, 4), gradient_as_bucket_view=True)
        assert hasattr(model, "_has_rebuilt_buckets") and not ddp_buckets_rebuilt(model)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
        model(torch.randn(2, 4))
        assert ddp_buckets_rebuilt(model)

    in_a_one_rank_group(check)
