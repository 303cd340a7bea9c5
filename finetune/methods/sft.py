"""Supervised fine-tuning: micro-batches of tokenized rows, next-token loss on trained tokens."""

from __future__ import annotations

from finetune.data.collate import collate
from finetune.data.masking import IGNORE
from finetune.methods import Context, pixels, register
from finetune.methods.head import LossHead, loss_head
from finetune.methods.loss import causal_lm_loss, trained_tokens


@register("sft")
class SFT:
    """Batches and loss for SFT; the training loop does the rest."""

    def __init__(
        self,
        pad_id: int,
        attn_implementation: str,
        micro_batch_size: int,
        validates: bool = True,
        head: LossHead | None = None,
        masks: dict | None = None,
        sample_index: bool = False,
        pixels=None,
        padding_free: bool = False,
    ):
        self.pad_id = pad_id
        self.attn = attn_implementation
        self.masks, self.sample_index = masks or {}, sample_index  # how packed rows keep samples apart (the Plan's)
        self.micro = micro_batch_size
        self.validates = validates
        self.head = head or LossHead()  # how the logits are computed (plan.loss_implementation)
        self.images = pixels  # a vision-language model's rows list their images (finetune.vision.Pixels)
        self.padding_free = padding_free  # unpacked rows concatenated into one row per micro-batch (the Plan's)

    @classmethod
    def create(cls, section, context: Context) -> SFT:
        plan = context.plan
        head = loss_head(plan, False)
        return cls(
            context.pad_id,
            context.attn,
            plan.micro_batch_size,
            section.validates,
            head,
            plan.attention_masks,
            plan.sample_index,
            pixels(context),
            plan.padding_free,
        )

    def micro_batches(self, dataset, indices: list[int]) -> list[dict]:
        """Collated micro-batches for one step's rows on this rank."""
        rows = dataset.select(indices)[:]
        rows = [dict(zip(rows, values)) for values in zip(*rows.values())]
        out, packed = [], bool(rows) and "seq_lens" in rows[0] and not self.padding_free
        for i in range(0, len(rows), self.micro):
            chunk = rows[i : i + self.micro]
            if self.padding_free:  # each row one sample of its own: the collator concatenates them (varlen)
                # a row's first label is no row's target once concatenated (the previous row's last position would
                # predict it), as in a padded batch, where nothing precedes it: IGNORE, as packing does
                chunk = [{**r, "labels": [IGNORE, *r["labels"][1:]], "seq_lens": [len(r["input_ids"])]} for r in chunk]
            batch = collate(chunk, self.pad_id, self.attn, masks=self.masks, sample_index=self.sample_index)
            if self.images is not None:  # the rows' images, in the order their tokens appear in the batch
                self.images.add(batch, [r.get("images") or [] for r in chunk], "seq_lens" in chunk[0])
            # packed rows: the trained positions the loss asks the model for, from the host before train.py moves the
            # batch (methods/head.py host_inputs; the planner sizes their logits: planner.one_row_batches)
            trained = self.head.host_inputs(batch) if packed else {}
            out.append({**batch, **trained, "num_tokens": sum(len(r["input_ids"]) for r in chunk)})
        return out

    def tokens(self, batch: dict) -> int:
        shifted = "shift_labels" in batch  # a rank's share of a sequence, shifted before the split (distributed/cp.py)
        return trained_tokens(batch["shift_labels" if shifted else "labels"], shifted)

    def loss(self, model, batch: dict, normaliser: float):
        return causal_lm_loss(model, batch, normaliser, self.head), {}
