"""Direct preference optimisation: micro-batches of (chosen, rejected) pairs, and the DPO loss.

Each micro-batch stacks the chosen sequences over the rejected ones, so one forward pass scores both.
A sequence's log-probability is the sum over its trained (completion) tokens. The reference is the
base with the adapter disabled (LoRA/QLoRA: no second copy), a frozen copy (full fine-tuning), or
log-probs computed once before training (`precomputed`). Losses, with Δ = (π_c − ref_c) − (π_r − ref_r):
  sigmoid  −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)         (ε: label_smoothing; DPO, conservative DPO)
  hinge    max(0, 1 − βΔ)                           (SLiC)
  ipo      (Δ_c/n_c − Δ_r/n_r − 1/(2β))²             (IPO, log-ratios averaged over completion tokens)
The step's loss is the mean over its pairs (the normaliser counts pairs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.data.collate import collate
from finetune.methods import Context, pixels, register
from finetune.methods.head import LossHead, loss_head
from finetune.methods.loss import metric


def pair_losses(
    kind: str, beta: float, smoothing: float, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens
):
    """Per-pair DPO losses from summed sequence log-probs (see the module docstring)."""
    c, r = chosen - ref_chosen, rejected - ref_rejected
    if kind == "sigmoid":
        return -(1 - smoothing) * F.logsigmoid(beta * (c - r)) - smoothing * F.logsigmoid(-beta * (c - r))
    if kind == "hinge":
        return torch.relu(1 - beta * (c - r))
    if kind == "ipo":
        return (c / chosen_tokens.clamp(min=1) - r / rejected_tokens.clamp(min=1) - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {kind!r}")


@register("dpo")
class DPO:
    """Batches and loss for DPO; `reference` gives the reference log-probs of a micro-batch."""

    images = None  # a vision-language model's pixels (finetune.vision.Pixels); subclasses that take no images keep it

    def __init__(
        self, section, pad_id: int, micro_batch_size: int, reference, head: LossHead | None = None, pixels=None
    ):
        self.beta, self.kind, self.smoothing = section.beta, section.loss, section.label_smoothing
        self.images = pixels  # a vision-language model's pairs list their prompt's images (finetune.vision.Pixels)
        self.pad_id, self.micro, self.reference = pad_id, micro_batch_size, reference
        self.validates = section.validates
        self.head = head or LossHead()  # how the logits are computed (plan.loss_implementation)
        self.held_out = None  # the validation rows, where a precomputed reference has a table of them

    @classmethod
    def create(cls, section, context: Context) -> DPO:
        """With the reference the plan chose; `precomputed` scores every row once, now, with the starting model."""
        plan = context.plan
        method = cls(
            section,
            context.pad_id,
            plan.micro_batch_size,
            reference_model(context),
            loss_head(plan, True),
            pixels(context),
        )
        if context.plan.reference == "precomputed":
            method.reference = precomputed_reference(context, method)
        return method

    def micro_batches(self, dataset, indices: list[int]) -> list[dict]:
        rows = dataset.select(indices)[:]
        out = []
        for i in range(0, len(indices), self.micro):
            part = slice(i, i + self.micro)
            seqs = [  # the chosen rows, then the rejected ones
                {"input_ids": ids, "labels": lab}
                for side in ("chosen", "rejected")
                for ids, lab in zip(rows[f"{side}_input_ids"][part], rows[f"{side}_labels"][part])
            ]
            batch = collate(seqs, self.pad_id, "sdpa")
            if self.images is not None:  # chosen rows then rejected rows, as stacked: each pair's images twice
                paths = [ps or [] for ps in rows["images"][part]]
                self.images.add(batch, paths + paths)
            batch.update(rows=torch.tensor(indices[part]), num_tokens=sum(len(x["input_ids"]) for x in seqs))
            batch[TABLE] = table_index(dataset, self.held_out)
            out.append(batch)
        return out

    def tokens(self, batch: dict) -> int:
        return len(batch["rows"])  # the step's loss is a mean over pairs

    def sequence_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logps, mask = self.head.token_logps(model, batch)
        return logps.sum(-1), mask.sum(-1)

    def policy_score(self, model, batch: dict) -> torch.Tensor:
        """What the reference model is asked for: summed log-probs of each sequence."""
        return self.sequence_logps(model, batch)[0]

    def loss(self, model, batch: dict, normaliser: float):
        logps, counts = self.sequence_logps(model, batch)
        chosen, rejected = logps.chunk(2)
        with torch.no_grad():
            ref_chosen, ref_rejected = self.reference(model, batch, self).to(logps.device).chunk(2)
        n_c, n_r = counts.chunk(2)
        losses = pair_losses(self.kind, self.beta, self.smoothing, chosen, rejected, ref_chosen, ref_rejected, n_c, n_r)
        metrics = {
            **reward_metrics(self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)),
            "logps/chosen": metric(chosen.mean()),
            "logps/rejected": metric(rejected.mean()),
        }
        return losses.sum() / normaliser, metrics


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a preference method logs of its implicit rewards (the names DPO logs), as metrics (methods/loss.py)."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "rewards/chosen": metric(chosen.mean()),
        "rewards/rejected": metric(rejected.mean()),
        "rewards/margin": metric((chosen - rejected).mean()),
        "rewards/accuracy": metric((chosen > rejected).float().mean()),
    }


def reference_model(context: Context):
    """The model DPO (always) and GRPO (with kl_coef > 0) compare the policy with, as the plan chose it: the base
    with the adapter disabled, or a frozen copy; None for `none` and `precomputed` (DPO computes those itself)."""
    if context.plan.reference == "adapter":
        return AdapterDisabled(context.engine.inner)
    if context.plan.reference == "copy":
        return FrozenCopy(context.frozen_copy())
    return None


class AdapterDisabled:
    """Reference = the model with its LoRA adapter switched off (peft), in the same forward machinery.
    References (here and below) serve DPO and GRPO: each asks `method.policy_score(model, batch)`."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def __call__(self, model, batch: dict, method) -> torch.Tensor:
        with self.peft_model.disable_adapter():
            return method.policy_score(model, batch)


class FrozenCopy:
    """Reference = a separate frozen copy of the starting model (full fine-tuning)."""

    def __init__(self, model):
        self.model = model.eval().requires_grad_(False)

    def __call__(self, model, batch: dict, method) -> torch.Tensor:
        return method.policy_score(self.model, batch)


TABLE = "table"  # a micro-batch's key: which rows its `rows` index, 0 the training rows, 1 the held-out ones


class Precomputed:
    """Reference log-probs of every row, computed once before training by the starting model: a batch's answer is
    its rows' first column, then their second, ... (DPO: chosen over rejected, as its micro-batches stack them).
    `held_out`: the same for the validation rows, which batches with TABLE 1 index."""

    def __init__(self, table: torch.Tensor, held_out: torch.Tensor | None = None):
        self.tables = [table] + ([held_out] if held_out is not None else [])  # (rows, sequences per row)

    @property
    def table(self) -> torch.Tensor:
        return self.tables[0]

    def columns(self, start: int, stop: int) -> Precomputed:
        """The table of some of the sequences of each row (KTO: its own, its mismatched pair's)."""
        return Precomputed(*(t[:, start:stop] for t in self.tables))

    def __call__(self, model, batch: dict, method) -> torch.Tensor:
        which = batch.get(TABLE, 0)
        table = self.tables[which]
        if table.device != batch["rows"].device:  # the batch's row indices are on the rank's GPU: index there
            table = self.tables[which] = table.to(batch["rows"].device)
        return torch.cat(table[batch["rows"]].unbind(1))


def table_index(dataset, held_out) -> int:
    """TABLE of a micro-batch of `dataset`: 1 for the held-out rows, else 0 (a Python int: it stays on the host when
    the batch moves to the device, so reading it never waits for the GPU)."""
    return int(held_out is not None and dataset is held_out)


def precomputed_reference(context: Context, method, batches=None) -> Precomputed:
    """The `precompute`d reference of the training rows and of the held-out ones, scored now by the starting model."""
    c = context
    method.held_out = c.validation
    return Precomputed(
        *(
            precompute(c.engine.model, method, data, c.runtime, c.device, c.autocast, batches).table
            for data in (c.dataset, c.validation)
            if data is not None
        )
    )


@torch.no_grad()
def precompute(model, method, dataset, runtime, device, autocast, batches=None, columns: int = 2) -> Precomputed:
    """Each rank scores a share of the rows (the same number of forward passes on every rank, as sharded
    models need), then a sum over ranks gives every rank the whole table. `batches(dataset, indices)` (default:
    the method's micro_batches) gives batches holding `rows` and, stacked, `columns` sequences per row (first
    column of every row, then the second, ...), which `method.policy_score` scores."""
    from finetune.distributed.runtime import data_share

    data_rank, world, leads = data_share(runtime)  # the ranks of a tp × cp block score the same rows together
    n = len(dataset)
    table = torch.zeros(n, columns, dtype=torch.float64)
    was_training = model.training
    model.eval()
    per_rank = -(-n // world)
    own = range(data_rank * per_rank, min(n, (data_rank + 1) * per_rank))
    mine = list(own) + [0] * (per_rank - len(own))  # padded: the same number of passes on every rank
    seen = set()
    for batch in (batches or method.micro_batches)(dataset, mine):
        rows = batch["rows"]
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        with autocast():
            logps = method.policy_score(model, batch).double().cpu().view(columns, len(rows))
        for j, row in enumerate(rows.tolist()):
            if row in own and row not in seen and leads:  # each row summed in once
                seen.add(row)
                table[row] = logps[:, j]
    model.train(was_training)
    if runtime.world_size > 1:
        torch.distributed.all_reduce(table)
    return Precomputed(table.float())
