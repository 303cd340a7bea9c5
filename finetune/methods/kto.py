"""Kahneman-Tversky optimisation (KTO) on unpaired feedback: each row is one completion, desirable or not.

A sequence's log-probability is the sum over its trained (completion) tokens; its log-ratio r = π − ref. The KL
baseline z is estimated from mismatched pairs: a row's prompt followed by another row's completion. With a reference
model (the base with the adapter disabled, or a frozen copy), the pairs are made within each micro-batch: row i's
prompt with row i−1's completion (row 0 takes the last row's), as trl rotates them. With `precomputed` reference
log-probs, computed once before training, each row's pair must be known in advance, so it is fixed by the data: row
i's prompt with the completion of row i−1 of the prepared dataset (row 0 with the last row's), the way trl builds its
KL dataset before shuffling; the table then holds, per row, the reference log-prob of its own sequence and of its
mismatched pair.
z = mean(π − ref) over the mismatched pairs of the whole step (every micro-batch, averaged over ranks), detached,
clamped at 0: the policy does not change within a step, so z is computed once, with the step's first micro-batch.
With one micro-batch per rank this is trl's z (trl estimates it per micro-batch, gathered over ranks); with
accumulation, ft's z does not depend on how the step is split into micro-batches and ranks, so 1 and N processes
train alike. Per row, with weights λ_D (desirable) and λ_U (undesirable):
  desirable    λ_D · (1 − σ(β(r − z)))
  undesirable  λ_U · (1 − σ(β(z − r)))
The step's loss is the mean over its rows (the normaliser counts rows). The reference is chosen as for DPO
(dpo.py's references and precompute).
"""

from __future__ import annotations

import torch

from finetune.data.collate import IGNORE, collate, to_device
from finetune.errors import FtError
from finetune.methods import Context, pixels, register
from finetune.methods.dpo import TABLE, precomputed_reference, reference_model, table_index
from finetune.methods.head import LossHead, loss_head
from finetune.methods.loss import metric

STEP_KL = "kl_step"  # the micro-batch's key for the step's mismatched pairs (StepKL), shared by its micro-batches
DESIRABLE, UNDESIRABLE = "desirable_rows", "undesirable_rows"  # the micro-batch's row numbers of each kind


def _completion_start(row: dict) -> int:
    return next(i for i, t in enumerate(row["labels"]) if t != IGNORE)


def mismatched(rows: list[dict], seq_len: int, others: list[dict] | None = None) -> list[dict]:
    """Row i's prompt with the completion of others[i] (by default row i−1's, row 0 with the last one's), cut to
    seq_len tokens."""
    others = others if others is not None else [rows[i - 1] for i in range(len(rows))]
    out = []
    for row, other in zip(rows, others, strict=True):
        start, cut = _completion_start(row), _completion_start(other)
        ids = list(row["input_ids"][:start]) + list(other["input_ids"][cut:])
        labels = [IGNORE] * start + list(other["labels"][cut:])
        # a vision-language model's row keeps its prompt's images (its image tokens are in the prompt, never cut: a
        # row is at most seq_len long)
        images = {"images": row["images"]} if row.get("images") else {}
        out.append({"input_ids": ids[:seq_len], "labels": labels[:seq_len], **images})
    return out


def partner(row: int, rows: int) -> int:
    """The dataset row whose completion row `row` is paired with when the pairs are fixed (precomputed reference)."""
    return (row - 1) % rows


def kto_losses(
    desirable: torch.Tensor, ratios: torch.Tensor, kl: torch.Tensor, beta: float, weights: tuple[float, float]
) -> torch.Tensor:
    """Per-row KTO losses from log-ratios π − ref and the KL baseline (see the module docstring)."""
    good = weights[0] * (1 - torch.sigmoid(beta * (ratios - kl)))
    bad = weights[1] * (1 - torch.sigmoid(beta * (kl - ratios)))
    return torch.where(desirable, good, bad)


def _mean(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean of the values of some rows (their numbers, counted on the host with the batch: selecting them needs no
    wait for the device, as a boolean mask would), as a metric; 0 where there are none (every micro-batch reports
    the same keys)."""
    if not len(rows):
        return metric(values.new_zeros(()))
    return metric(values.index_select(0, rows.to(values.device)).mean())


def _sequences(columns: dict) -> list[dict]:
    rows = [{"input_ids": ids, "labels": lab} for ids, lab in zip(columns["input_ids"], columns["labels"])]
    for row, paths in zip(rows, columns.get("images") or ()):  # a vision-language model's rows
        row["images"] = paths or []
    return rows


@register("kto")
class KTO:
    """Batches and loss for KTO; `reference` gives the reference log-probs of a batch's sequences (dpo.py's), and
    `kl_reference` those of its mismatched pairs (the same model, or the precomputed table's second column).
    `fixed_pairs`: pair each row with its dataset partner (precomputed) instead of rotating within micro-batches."""

    def __init__(
        self,
        section,
        pad_id: int,
        micro_batch_size: int,
        seq_len: int,
        reference,
        runtime=None,
        head=None,
        fixed_pairs: bool = False,
        pixels=None,
    ):
        self.beta, self.weights = section.beta, (section.desirable_weight, section.undesirable_weight)
        self.pad_id, self.micro, self.seq_len = pad_id, micro_batch_size, seq_len
        self.images = pixels  # rows whose prompt holds images (finetune.vision.Pixels)
        self.reference = self.kl_reference = reference
        self.runtime = runtime  # the KL baseline is averaged over ranks
        self.fixed_pairs = fixed_pairs
        self.held_out = None  # the validation rows, where a precomputed reference has a table of them
        self.validates = section.validates
        self.head = head or LossHead()  # how the logits are computed (plan.loss_implementation)

    @classmethod
    def create(cls, section, context: Context) -> KTO:
        """With the reference the plan chose; `precomputed` scores every row and its fixed pair once, now."""
        plan, precomputed = context.plan, context.plan.reference == "precomputed"
        if plan.micro_batch_size < 2 and not precomputed:  # `auto` chose 1 (an explicit 1 is refused by the checks)
            raise FtError(
                "train.micro_batch_size: the plan chose 1 row per micro-batch, and KTO pairs each prompt with another "
                "row's completion of its micro-batch for its KL baseline; set train.micro_batch_size: 2 (or more), "
                "with a memory saver or more devices if it does not fit (see ft plan), or set method.reference: "
                "precomputed, which pairs rows across the dataset"
            )
        reference = reference_model(context)
        method = cls(
            section,
            context.pad_id,
            plan.micro_batch_size,
            plan.seq_len,
            reference,
            context.runtime,
            loss_head(plan, True),
            fixed_pairs=precomputed,
            pixels=pixels(context),
        )
        if precomputed:
            both = precomputed_reference(context, method, method.reference_batches)
            method.reference, method.kl_reference = both.columns(0, 1), both.columns(1, 2)
        return method

    def _chunks(self, dataset, indices: list[int]):
        """Per micro-batch: its row indices, sequences, mismatched pairs and labels."""
        rows = dataset.select(indices)[:]
        seqs = _sequences(rows)
        others = None
        if self.fixed_pairs:
            others = _sequences(dataset.select([partner(i, len(dataset)) for i in indices])[:])
        for i in range(0, len(indices), self.micro):
            part = slice(i, i + self.micro)
            kl = mismatched(seqs[part], self.seq_len, others[part] if others is not None else None)
            yield indices[part], seqs[part], kl, rows["desirable"][part]

    def micro_batches(self, dataset, indices: list[int]) -> list[dict]:
        out, step, table = [], StepKL([], self.runtime), table_index(dataset, self.held_out)
        for part, seqs, kl, desirable in self._chunks(dataset, indices):
            step.batches.append({**self._collate(kl), "rows": torch.tensor(part), TABLE: table})
            batch = self._collate(seqs)
            good = torch.tensor(desirable, dtype=torch.bool)
            batch.update(
                {STEP_KL: step, DESIRABLE: good.nonzero().flatten(), UNDESIRABLE: (~good).nonzero().flatten()},
                rows=torch.tensor(part),
                desirable=good,
                num_tokens=sum(len(x["input_ids"]) for x in seqs + kl),
            )
            batch[TABLE] = table
            out.append(batch)
        return out

    def reference_batches(self, dataset, indices: list[int]) -> list[dict]:
        """What `precompute` scores: per micro-batch, its rows' sequences stacked over their mismatched pairs."""
        return [
            {**self._collate(seqs + kl), "rows": torch.tensor(part)}
            for part, seqs, kl, _ in self._chunks(dataset, indices)
        ]

    def _collate(self, seqs: list[dict]) -> dict:
        """The sequences as one batch, with their images' pixels on a vision-language model."""
        batch = collate(seqs, self.pad_id, "sdpa")
        if self.images is not None:
            self.images.add(batch, [s.get("images") or [] for s in seqs])
        return batch

    def tokens(self, batch: dict) -> int:
        return len(batch["rows"])  # the step's loss is a mean over rows

    def sequence_logps(self, model, batch: dict) -> torch.Tensor:
        """Summed log-probs of each sequence: what the loss and the KL baseline read."""
        logps, _ = self.head.token_logps(model, batch)
        return logps.sum(-1)

    policy_score = sequence_logps  # what the reference model is asked for: the same sums

    def loss(self, model, batch: dict, normaliser: float):
        kl = batch[STEP_KL].baseline(model, self, batch["input_ids"].device)
        logps = self.sequence_logps(model, batch)
        with torch.no_grad():
            ref_logps = self.reference(model, batch, self).to(logps.device)
        kl = kl.to(logps.device)
        desirable = batch["desirable"].to(logps.device)
        losses = kto_losses(desirable, logps - ref_logps, kl, self.beta, self.weights)
        rewards = self.beta * (logps - ref_logps).detach()
        good, bad = batch[DESIRABLE], batch[UNDESIRABLE]
        chosen, rejected = _mean(rewards, good), _mean(rewards, bad)
        metrics = {
            "kl": metric(kl),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margin": chosen - rejected,  # float64, as Python's difference of the two was
            "logps/chosen": _mean(logps.detach(), good),
            "logps/rejected": _mean(logps.detach(), bad),
        }
        return losses.sum() / normaliser, metrics


class StepKL:
    """The mismatched pairs of one step's micro-batches on this rank, and the KL baseline z they give (computed by the
    first micro-batch's loss, with the same number of forward passes on every rank, as sharded models need)."""

    def __init__(self, batches: list[dict], runtime=None):
        self.batches, self.runtime, self.value = batches, runtime, None

    @torch.no_grad()
    def baseline(self, model, method: KTO, device) -> torch.Tensor:
        """z on the device, never read on the host (summed in float64 there, as Python summed the values before)."""
        if self.value is None:
            total, count = 0.0, 0
            for kl in self.batches:
                kl = to_device(kl, device)
                ratios = method.sequence_logps(model, kl) - method.kl_reference(model, kl, method).to(device)
                total, count = total + ratios.double().sum(), count + len(ratios)
            z = torch.as_tensor(total, dtype=torch.float64, device=device) / max(count, 1)
            if self.runtime is not None and self.runtime.world_size > 1:
                # on GPUs a CUDA tensor: ft's process group (cpu:gloo,cuda:nccl) reduces it with NCCL, on the device
                torch.distributed.all_reduce(z)
                z = z / self.runtime.world_size
            self.value = z.float().clamp(min=0)
        return self.value
