"""Padding-free SFT batches (plan/attention.py Attention.padding_free): the planner concatenates an unpacked
micro-batch's rows into one row where the loss is a sum over tokens and the class runs ft's sdpa_varlen, and says why;
the concatenated batch carries no padding and gives the padded batch's loss and every gradient."""

from __future__ import annotations

import pytest
import torch

from finetune.catalog import lookup
from finetune.config import loads
from finetune.hardware import parse
from finetune.plan import plan
from tests.helpers import MINIMAL, make_examples, tiny_llama


def planned(*overrides: str, model: str = "ft-tiny", hardware: str = "cpu"):
    config = loads(MINIMAL, overrides=[f"model.name={model}", "data.seq_len=256", *overrides], environ={})
    return plan(config, parse(hardware), lookup(model))


def test_unpacked_sft_runs_padding_free_and_the_plan_says_why():
    p = planned("data.packing=false", "train.max_steps=100")
    assert (p.attn_implementation, p.padding_free) == ("sdpa_varlen", True)
    assert "padding-free" in p.decision("attn_implementation").reason
    assert type(p).from_json(p.to_json()).padding_free is True


@pytest.mark.parametrize(
    "hardware, precision, flat",
    [
        ("1xH100-80GB", "auto", True),  # sm90, bf16: torch's varlen kernel takes the concatenated row
        ("1xA100-40GB", "fp16", True),
        ("1xA100-40GB", "fp32", False),  # the kernel takes half precision only: one SDPA per sample would be slower
        ("1xV100-32GB", "auto", False),  # sm70: no varlen kernel
    ],
)
def test_gpus_run_padding_free_only_where_the_varlen_kernel_takes_the_row(hardware, precision, flat):
    p = planned("data.packing=false", "train.max_steps=100", f"train.precision={precision}", hardware=hardware)
    assert p.padding_free is flat
    assert p.attn_implementation == ("sdpa_varlen" if flat else "sdpa")


@pytest.mark.parametrize(
    "overrides",
    [
        ("data.packing=true",),  # packed rows: sample boundaries inside rows, as before
        ("data.packing=false", "method.name=dpo", "data.datasets.0.format=preference"),  # pairs: the loss reads rows
        ("data.packing=false", "train.compile=true"),  # compiled layers keep a batch's shapes: padded rows
        ("data.packing=false", "model.attn_implementation=sdpa"),  # what the config names
    ],
)
def test_padded_rows_where_rows_matter_or_the_config_says(overrides):
    p = planned(*overrides, "train.max_steps=100")
    assert p.padding_free is False
    if "data.packing=false" in overrides:
        assert p.attn_implementation == "sdpa"


@pytest.mark.parametrize("trained", ["after a prompt", "every token"])
def test_a_padding_free_micro_batch_has_no_padding_and_gives_the_padded_loss_and_gradients(trained):
    """Also where a row's first token is trained (train_on: all, completion data): concatenated, the previous row's
    last position must not learn to predict it, and the step's trained tokens stay those of the padded batch."""
    import datasets

    from finetune.attention import register
    from finetune.methods.head import LossHead
    from finetune.methods.sft import SFT

    examples = make_examples([23, 9, 17, 30, 12, 5], seed=4)
    if trained == "every token":
        examples = [{**e, "labels": list(e["input_ids"])} for e in examples]
    rows = datasets.Dataset.from_list(examples)
    model = tiny_llama(register()).train()
    padded = SFT(0, "sdpa_varlen", 3).micro_batches(rows, list(range(6)))
    flat = SFT(0, "sdpa_varlen", 3, padding_free=True).micro_batches(rows, list(range(6)))
    assert [b["input_ids"].shape for b in padded] == [(3, 23), (3, 30)]
    assert [b["input_ids"].shape for b in flat] == [(1, 49), (1, 47)]  # every token real, nothing padded
    assert [b["num_tokens"] for b in flat] == [b["num_tokens"] for b in padded] == [49, 47]
    sft = SFT(0, "sdpa_varlen", 3)
    assert [sft.tokens(b) for b in flat] == [sft.tokens(b) for b in padded]  # the loss's divisor

    def summed(batches):
        model.zero_grad(set_to_none=True)
        head = LossHead()
        total = sum(head.summed_nll(model, b) for b in batches)
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    (loss_a, grads_a), (loss_b, grads_b) = summed(padded), summed(flat)
    assert float(loss_a) > 0 and torch.allclose(loss_a, loss_b, rtol=1e-5)
    for name, grad in grads_a.items():
        assert torch.allclose(grad, grads_b[name], rtol=1e-4, atol=1e-6), name


def test_the_planner_knows_which_kernels_get_packed_rows_as_one_row():
    from finetune.data.collate import VARLEN_IMPLS
    from finetune.plan.planner import VARLEN_KERNELS

    assert set(VARLEN_KERNELS) == set(VARLEN_IMPLS)  # the plain loss's logits are sized for one-row micro-batches
