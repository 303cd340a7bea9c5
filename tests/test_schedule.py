"""The learning-rate schedule: ft's multipliers give transformers' get_scheduler values step for step (the oracle), a
schedule saved by either resumes under the other, and building it pulls in neither peft nor bitsandbytes."""

import io
import subprocess
import sys

import pytest
import torch

from finetune.config.schema import TrainSection
from finetune.optim import build_scheduler

NAMES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}
SHAPES = [(0, 1), (0, 10), (3, 10), (10, 10), (7, 8), (25, 250), (1, 3)]


def optimizer(lr: float = 3e-4) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def transformers_schedule(kind: str, warmup: int, total: int, opt=None):
    from transformers import get_scheduler

    return get_scheduler(NAMES[kind], opt or optimizer(), num_warmup_steps=warmup, num_training_steps=total)


def ft_schedule(kind: str, warmup: int, total: int, opt=None):
    return build_scheduler(opt or optimizer(), TrainSection(scheduler=kind, warmup_steps=warmup), total)


def lrs(schedule, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    return out


@pytest.mark.parametrize("kind", sorted(NAMES))
@pytest.mark.parametrize("warmup,total", SHAPES)
def test_every_step_has_the_learning_rate_transformers_gives(kind, warmup, total):
    ours, theirs = (
        lrs(ft_schedule(kind, warmup, total), total + 2),
        lrs(transformers_schedule(kind, warmup, total), total + 2),
    )
    assert ours == theirs  # exactly: the same formulas in the same order
    assert ours[0] == (0.0 if warmup else 3e-4)


def test_warmup_ratio_counts_steps_of_the_whole_run():
    ours = lrs(build_scheduler(optimizer(), TrainSection(warmup_ratio=0.1), 50), 52)
    assert ours == lrs(transformers_schedule("cosine", 5, 50), 52)


@pytest.mark.parametrize("writer", ["ft", "transformers"])
def test_a_saved_schedule_resumes_under_the_other_with_the_same_learning_rates(writer):
    """scheduler.pt written by the schedule of either side (as before and after ft stopped calling get_scheduler)
    loads with weights_only and continues where the uninterrupted schedule goes."""
    make = {"ft": ft_schedule, "transformers": transformers_schedule}
    first = make[writer]("cosine", 4, 20)
    lrs(first, 9)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make["transformers" if writer == "ft" else "ft"]("cosine", 4, 20)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    whole = lrs(make[writer]("cosine", 4, 20), 20)
    assert resumed.last_epoch == 9 and lrs(resumed, 11) == whole[9:]


@pytest.mark.slow
def test_building_the_schedule_imports_neither_peft_nor_bitsandbytes():
    """transformers.get_scheduler imports transformers' Trainer utilities, and through them peft and bitsandbytes
    (~1.8 s of CPU): a full fine-tuning rank needs neither."""
    code = (
        "import sys, torch\n"
        "from finetune.config.schema import TrainSection\n"
        "from finetune.optim import build_scheduler, build_optimizer\n"
        "p = [torch.nn.Parameter(torch.zeros(2))]\n"
        "s = build_scheduler(torch.optim.AdamW(p, lr=1e-3), TrainSection(), 10)\n"
        "print(sorted(m for m in ('peft', 'bitsandbytes', 'transformers.optimization') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
