"""Host syncs of a training step, per method: ft reads what the device computed once per optimizer step (train.py:
the step's losses, gradient norm and the method's metrics, together), never inside a micro-batch, where each read
would stall a GPU before the backward pass is even queued.

On CPU nothing waits, so the reads are counted instead (`HostReads`): every call from ft's own code (finetune/) that
would wait for a GPU, `.item()`, `.tolist()`, `float()`, `int()`, `bool()`, `.cpu()`, `.numpy()` and indexing by a
boolean mask, while the step's device phases run (each micro-batch's loss and backward pass, the optimizer step, the
final read). What the methods do on the host before that (collating rows, counting trained tokens, GRPO's rollout)
is counted apart: it reads host data, except GRPO's old-policy log-probabilities (one `.cpu()` per micro-batch where
num_iterations > 1 or an importance weight needs them).
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import finetune
from finetune.tiny import preference_records, prompt_records, unpaired_records, write_jsonl
from tests.helpers import job_text, setup_job

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "nonzero", "masked_select"}
FT = str(Path(finetune.__file__).parent)


class HostReads(TorchFunctionMode):
    """Counts, by `where` (file:function), the host reads of tensors that ft's own code makes while it is entered."""

    def __init__(self):
        super().__init__()
        self.where = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name == "__getitem__" and _boolean_index(args[1])
        if name in READS or masked:
            caller = sys._getframe(1).f_code  # the Python code that made the call
            if caller.co_filename.startswith(FT):
                self.where[f"{Path(caller.co_filename).name}:{caller.co_name}:{name}"] += 1
        return func(*args, **(kwargs or {}))


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(p) and p.dtype == torch.bool for p in parts)


def counting(job, monkeypatch) -> dict[str, HostReads]:
    """Counters of the job's device phases (`step`) and of its micro-batches made on the host (`batches`)."""
    from finetune import train

    reads = {"step": HostReads(), "batches": HostReads()}

    def within(mode, real, *args, **kwargs):
        with mode:
            return real(*args, **kwargs)

    for owner, name, phase in (
        (job.method, "loss", "step"),
        (job.engine, "backward", "step"),
        (job.engine, "step", "step"),
        (job.method, "micro_batches", "batches"),
    ):
        monkeypatch.setattr(owner, name, functools.partial(within, reads[phase], getattr(owner, name)))
    monkeypatch.setattr(train, "host_values", functools.partial(within, reads["step"], train.host_values))
    return reads


def method_job(tmp_path, method: str) -> str:
    """ft-tiny, full fine-tuning, 2 micro-batches of 4 rows a step, with `method` on data of its format."""
    formats = {"dpo": "preference", "orpo": "preference", "simpo": "preference", "reward": "preference"}
    fmt = {"kto": "unpaired", "grpo": "prompt_only"}.get(method, formats.get(method, "chat"))
    records = {"preference": preference_records, "unpaired": unpaired_records, "prompt_only": prompt_records}
    data = None if fmt == "chat" else write_jsonl(records[fmt](64, seed=3), tmp_path / f"{fmt}.jsonl")
    section = {
        "grpo": "{name: grpo, num_generations: 4, max_new_tokens: 4, num_iterations: 2, kl_coef: 0.05, "
        "rewards: [{function: length_penalty, args: {limit: 4}}]}",
        "kto": "{name: kto, reference: copy}",
    }.get(method, f"{{name: {method}}}")
    text = job_text(tmp_path, "full", steps=4, batch=8, micro=4, data=data, extra=f"method: {section}")
    return text.replace("format: chat", f"format: {fmt}")


METHODS = ["sft", "dpo", "orpo", "simpo", "kto", "reward", "grpo"]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_training_step_reads_the_device_once_whatever_the_method(tmp_path, monkeypatch, method):
    from finetune.train import train_step

    _, plan, _, job = setup_job(tmp_path, method_job(tmp_path, method))
    assert plan.gradient_accumulation_steps == 2
    reads = counting(job, monkeypatch)
    steps = 2 if method == "grpo" else 3  # GRPO: a rollout, then its second iteration (num_iterations: 2)
    for _ in range(steps):
        metrics = train_step(job)
    assert all(isinstance(v, float | int) for v in metrics.values()), metrics
    assert dict(reads["step"].where) == {"loss.py:host_values:tolist": steps}, dict(reads["step"].where)
    if method == "grpo":  # the rollout's old-policy log-probs: one read per micro-batch of the one rollout
        assert reads["batches"].where["grpo.py:policy:cpu"] == 2, dict(reads["batches"].where)
    else:
        assert not any(k.endswith((":cpu", ":numpy")) for k in reads["batches"].where), dict(reads["batches"].where)
