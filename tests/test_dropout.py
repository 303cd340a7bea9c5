"""LoRA dropout on a CPU that draws only the dropped positions (finetune/dropout.py): the same distribution as
nn.Dropout, the same drops in the backward pass, under recomputation and from the same seed; planned on a CPU only."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from finetune.dropout import SparseDropout, dropped_positions, use_sparse_dropout


def mask_of(n: int, p: float, **kw) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[dropped_positions(n, p, **kw)] = True
    return mask


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7])
@pytest.mark.parametrize("draw", [None, 7])  # 7: a draw of gaps runs short many times per tensor (the loop's joins)
def test_each_element_is_dropped_on_its_own_with_probability_p(p, draw):
    """Every pattern of three neighbours occurs as often as independent drops with probability p make it, which a wrong
    gap distribution, an off-by-one between draws or a lost tail fails."""
    torch.manual_seed(1)
    triples = 40_000
    mask = torch.cat([mask_of(3 * 4000, p, draw=draw) for _ in range(triples // 4000)]).view(-1, 3).long()
    codes = mask[:, 0] * 4 + mask[:, 1] * 2 + mask[:, 2]
    counts = torch.bincount(codes, minlength=8).double()
    expected = torch.tensor(
        [p ** sum(bits) * (1 - p) ** (3 - sum(bits)) for bits in itertools.product((0, 1), repeat=3)],
        dtype=torch.float64,
    )
    expected *= triples
    assert chi_square(counts, expected) < 30, (counts, expected)  # 7 degrees of freedom: p-value below 1e-4
    rate = mask.double().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / mask.numel())


def test_drops_are_spread_over_the_whole_tensor():
    torch.manual_seed(2)
    n, p, bins = 64 * 1024, 0.05, 16
    counts = sum(mask_of(n, p).view(bins, -1).sum(1).double() for _ in range(20))
    expected = torch.full((bins,), 20 * n * p / bins, dtype=torch.float64)
    assert chi_square(counts, expected) < 45  # 15 degrees of freedom: p-value below 1e-4


def test_positions_are_sorted_distinct_and_inside():
    torch.manual_seed(3)
    for n, p in [(1, 0.5), (10, 0.05), (1000, 0.99), (5000, 0.01)]:
        pos = dropped_positions(n, p, draw=3)
        assert pos.dtype == torch.long
        assert bool((pos[1:] > pos[:-1]).all()) and (pos.numel() == 0 or (0 <= pos[0] and pos[-1] < n))
    assert dropped_positions(100, 0.0).numel() == 0 and dropped_positions(0, 0.5).numel() == 0


def test_forward_and_backward_drop_the_same_elements_and_scale_the_rest():
    torch.manual_seed(4)
    p = 0.25
    x = torch.randn(33, 17, requires_grad=True)
    w = torch.randn(33, 17)
    y = SparseDropout(p)(x)
    (y * w).sum().backward()
    kept = y != 0
    assert 0.6 < kept.double().mean() < 0.9
    torch.testing.assert_close(y[kept], x.detach()[kept] / (1 - p))
    torch.testing.assert_close(x.grad, torch.where(kept, w / (1 - p), torch.zeros_like(w)))


def test_a_view_that_is_not_contiguous_drops_like_its_copy():
    x = torch.randn(8, 12).t()  # transposed: not contiguous
    torch.manual_seed(5)
    a = SparseDropout(0.5)(x)
    torch.manual_seed(5)
    b = SparseDropout(0.5)(x.contiguous())
    torch.testing.assert_close(a, b)


def test_eval_mode_and_zero_probability_leave_the_input():
    x = torch.randn(4, 4)
    assert SparseDropout(0.3).eval()(x) is x
    assert SparseDropout(0.0)(x) is x
    with pytest.raises(ValueError):
        SparseDropout(1.0)


def test_the_same_seed_draws_the_same_drops():
    x = torch.randn(50, 50)
    torch.manual_seed(6)
    a = SparseDropout(0.1)(x)
    torch.manual_seed(6)
    b = SparseDropout(0.1)(x)
    c = SparseDropout(0.1)(x)
    assert torch.equal(a, b) and not torch.equal(b, c)


def test_a_recomputed_layer_draws_the_drops_of_its_first_forward():
    """Activation checkpointing runs the forward again in the backward pass: torch restores the CPU generator first,
    so the gradients equal those of the layer run once."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(7)
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(8, 16)
    drop = SparseDropout(0.3)

    def layer(x):
        return b(drop(a(x)))

    x = torch.randn(32, 16)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(8)
        out = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
        out.square().sum().backward()
        grads.append([a.weight.grad.clone(), b.weight.grad.clone()])
        a.zero_grad(), b.zero_grad()
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def test_peft_layers_take_it_and_keep_their_probability():
    from peft import LoraConfig, get_peft_model

    from tests.helpers import tiny_llama

    model = get_peft_model(tiny_llama("sdpa").train(), LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear"))
    assert use_sparse_dropout(model) == 2 * 7  # seven projections in each of two layers
    drops = [d for m in model.modules() if hasattr(m, "lora_dropout") for d in m.lora_dropout.values()]
    assert drops and all(isinstance(d, SparseDropout) and d.p == 0.1 and d.training for d in drops)
    ids = torch.randint(0, 256, (2, 24))
    torch.manual_seed(9)
    first = model(input_ids=ids).logits
    # lora_B starts at zero: make the adapter matter, then the drops change the logits in train mode, not in eval mode
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    train_a, train_b = model(input_ids=ids).logits, model(input_ids=ids).logits
    model.eval()
    assert not torch.equal(train_a, train_b)
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
    assert first.shape == train_a.shape


@pytest.mark.parametrize(
    ("hardware", "overrides", "sparse"),
    [
        ("cpu", [], True),
        ("cpu", ["adapter.dropout=0"], False),
        ("1xH100-80GB", [], False),
    ],
)
def test_the_plan_draws_sparse_dropout_on_a_cpu_only(hardware, overrides, sparse):
    from finetune.catalog import lookup
    from finetune.config import loads
    from finetune.hardware import parse
    from finetune.plan import plan
    from tests.helpers import MINIMAL

    cfg = loads(MINIMAL, overrides=["model.name=meta-llama/Llama-3.2-1B", "data.seq_len=256", *overrides], environ={})
    made = plan(cfg, parse(hardware), lookup("meta-llama/Llama-3.2-1B"))
    assert made.adapter == "lora" and made.sparse_dropout is sparse
    shown = [d for d in made.decisions if d.field == "adapter.dropout"]
    assert bool(shown) is sparse and (not sparse or "sparse" in str(shown[0].value))
    assert type(made).from_json(made.to_json()).sparse_dropout is sparse


def test_apply_adapter_follows_the_plan():
    from types import SimpleNamespace

    from finetune.adapters import apply_adapter
    from finetune.config.schema import AdapterSection
    from tests.helpers import tiny_llama

    fields = dict(adapter="lora", quantization="none", precision="fp32", head=None, train_embeddings=False)
    section = AdapterSection(type="lora", r=4, alpha=8, dropout=0.1)
    for sparse in (False, True):
        plan = SimpleNamespace(**fields, pure_bf16=False, sparse_dropout=sparse)
        model = apply_adapter(tiny_llama("sdpa"), section, plan)
        kinds = {type(d) for m in model.modules() if hasattr(m, "lora_dropout") for d in m.lora_dropout.values()}
        assert kinds == ({SparseDropout} if sparse else {torch.nn.Dropout})


@pytest.mark.slow
def test_a_run_stopped_and_resumed_draws_the_drops_of_the_uninterrupted_one(tmp_path):
    """LoRA dropout 0.05 on a CPU (sparse draws): the checkpoint keeps the generator's state, so a run stopped at step 3
    and resumed ends with the uninterrupted run's weights, and both differ from a run without dropout."""
    import signal

    from finetune import checkpoint
    from finetune.errors import Stopped
    from finetune.train import SignalStop, run, setup
    from tests.helpers import job_text, setup_job

    text = job_text(tmp_path, "lora", steps=6).replace("save_steps: 0", "save_steps: 100")
    config, p, prepared, job = setup_job(tmp_path, text.replace("dropout: 0.0", "dropout: 0.05"))
    assert p.sparse_dropout and any(isinstance(m, SparseDropout) for m in job.model.modules())
    (tmp_path / "run").mkdir()
    run(job, tmp_path / "run")
    straight = {n: t.detach().clone() for n, t in job.model.named_parameters() if t.requires_grad}

    stop = SignalStop()

    def hook(step, total, row):
        if step == 3:
            stop.signum = signal.SIGTERM

    (tmp_path / "run2").mkdir()
    with pytest.raises(Stopped):
        run(setup(config, p, prepared), tmp_path / "run2", on_step=hook, stop=stop)
    resumed_job = setup(config, p, prepared)
    run(resumed_job, tmp_path / "run2", resume_from=checkpoint.latest(tmp_path / "run2"))
    resumed = {n: t.detach() for n, t in resumed_job.model.named_parameters() if t.requires_grad}
    assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) == 0.0

    (tmp_path / "plain" / "run").mkdir(parents=True)
    plain_config, plain_plan, plain_data, plain_job = setup_job(tmp_path / "plain", text)
    assert not plain_plan.sparse_dropout
    run(plain_job, tmp_path / "plain" / "run")
    without = {n: t.detach() for n, t in plain_job.model.named_parameters() if t.requires_grad}
    assert max((straight[n] - without[n]).abs().max().item() for n in straight) > 1e-4  # the drops changed training
