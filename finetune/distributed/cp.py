"""Context parallelism: each sequence of a micro-batch split over the `cp` ranks of a context-parallel group, whose
attention is torch's ring attention (torch.distributed.tensor.experimental.context_parallel).

What a rank does with a micro-batch (`shard`, called on every micro-batch before its trained tokens are counted):
- the labels are shifted once, over the whole sequence (`shift_labels[t]` is the token at t + 1, IGNORE at the end),
  before anything is split, so that the target of each rank's last position is the first token of the next chunk; the
  local batch carries `shift_labels` and no `labels`, and the loss (methods/head.py) uses them as they are, never
  shifting again;
- the sequence is padded to a multiple of 2·cp and cut into 2·cp chunks; rank r keeps chunks r and 2·cp − 1 − r (the
  head-tail load balancing of torch's `_HeadTailLoadBalancer`, which its causal ring attention assumes: every rank
  then does the same share of the causal work);
- input_ids and position_ids (the rotary embedding reads the global positions) go with the chunks; the
  attention_mask becomes all ones: transformers then passes no mask and `is_causal=True` to SDPA, which is what the
  ring attention computes (a right-padded row loses nothing: a real token never attends to the padding after it,
  and padded positions are never targets). Without a mask transformers would read the reordered position_ids as
  packed sequences and build a 4-D mask, which the ring attention refuses.
Each rank counts the trained tokens of its own chunks, so the step's normaliser (methods/loss.py: trained tokens
summed over all ranks, divided by the world size) stays the global token mean: the gradients of a context-parallel
group are averaged with the data-parallel ones (DDP over all ranks; FSDP2 over dp × cp, mesh.shard_mesh).

`ContextParallel.attention()` is entered around each micro-batch's forward and backward (TorchEngine.accumulating):
torch's `context_parallel` replaces torch.nn.functional.scaled_dot_product_attention by its ring attention for the
block. The backward pass must run inside it too: the ring attention's backward ops are dispatched by the same handlers.

Where it runs (torch 2.13, _context_parallel/_attention.py): the ring handlers serve the CUDA kernels only
(aten._scaled_dot_product_{flash,efficient,cudnn}_attention and their backwards). On CPUs SDPA dispatches to
aten._scaled_dot_product_flash_attention_for_cpu, which has no DTensor sharding rule at all: a forward fails with
NotImplementedError (measured, 2 gloo processes). So `check` refuses context parallelism on CPUs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from finetune.data.masking import IGNORE
from finetune.errors import FtError

KEY = "distributed.context_parallel"
SEQUENCE = ("input_ids", "labels", "position_ids", "attention_mask")  # what `shard` splits
VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # packed, padding-free batches


def check(
    seq_len: int,
    cp: int,
    attn_implementation: str,
    packing: bool,
    method: str,
    *,
    summed_loss: bool,
    device: str = "GPU",
    backend: str = "fsdp",
    sliding_window: int | None = None,
    compile: bool = False,
) -> list[str]:
    """Why a job cannot run with context-parallel degree `cp` (empty: it can). `device` is plan.device ("GPU" or
    "CPU process"), `attn_implementation` the planned kernel, `summed_loss` the method section's (its loss may be
    split over ranks), `sliding_window` the model's (None: full attention)."""
    if cp <= 1:
        return []
    fix = f"or set {KEY}: 1"
    problems = []
    if device != "GPU":
        problems.append(
            f"{KEY}: {cp} needs CUDA GPUs: torch 2.13's ring attention replaces the GPU attention kernels (flash, "
            "memory-efficient, cuDNN) and has none for the CPU kernel (_scaled_dot_product_flash_attention_for_cpu); "
            f"set {KEY}: 1 on CPUs"
        )
    if seq_len % (2 * cp):
        problems.append(
            f"{KEY}: {cp} needs data.seq_len divisible by 2 × {cp} = {2 * cp} (each sequence is cut into 2·cp chunks "
            f"for causal load balancing), and it is {seq_len}; set data.seq_len to {-(-seq_len // (2 * cp)) * 2 * cp}, "
            + fix
        )
    if attn_implementation != "sdpa":
        problems.append(
            f"{KEY}: {cp} runs torch's ring attention, which replaces SDPA; the attention is {attn_implementation}: "
            f"set model.attn_implementation: sdpa (and data.packing: false), {fix}"
        )
    if packing:
        problems.append(
            f"{KEY}: {cp} splits one causal sequence per row; packed rows need a mask per example (4-D masks or "
            f"varlen boundaries), which the ring attention cannot take: set data.packing: false, {fix}"
        )
    if not summed_loss:
        problems.append(
            f"{KEY}: {cp} is implemented for method.name: sft (its next-token loss sums over tokens wherever they "
            f"are); {method} needs whole sequences on one rank: {fix}"
        )
    if backend not in ("ddp", "fsdp"):
        problems.append(
            f"{KEY}: {cp} runs under distributed.backend fsdp or ddp (ft's own engine), not {backend}: set "
            f"distributed.backend: fsdp, {fix}"
        )
    if sliding_window is not None and sliding_window < seq_len:
        problems.append(
            f"{KEY}: {cp}: the model's sliding-window attention ({sliding_window} tokens, shorter than data.seq_len "
            f"{seq_len}) needs a mask, and the ring attention computes plain causal attention; {fix}"
        )
    if compile:
        problems.append(
            f"{KEY}: {cp}: ft does not compile layers whose attention torch's context parallelism replaces at run "
            f"time; set train.compile: false, {fix}"
        )
    return problems


def head_tail_order(length: int, cp: int) -> torch.Tensor:
    """Positions 0..length-1 in the order the ranks hold them: rank r's part is chunks r and 2·cp − 1 − r of 2·cp
    equal chunks (the same as torch's _HeadTailLoadBalancer, tests/test_context_parallel.py compares them)."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 × {cp} equal chunks")
    chunks = torch.arange(length).view(2 * cp, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def local_positions(length: int, rank: int, cp: int) -> torch.Tensor:
    """The positions of a sequence of `length` (a multiple of 2·cp) that rank `rank` of `cp` holds, in its order."""
    return head_tail_order(length, cp).view(cp, -1)[rank]


def shard(batch: dict, rank: int, cp: int) -> dict:
    """Rank `rank`'s part of a collated micro-batch (input_ids, labels, position_ids, attention_mask: (B, T)), with its
    labels shifted over the whole sequence first (`shift_labels`; see the module's text). Other entries pass through;
    `num_tokens` becomes this rank's share of the real tokens. Runs on the collated CPU tensors, before train.py moves
    the batch to the rank's device (on GPUs too: indexing only, no collective)."""
    if any(k in batch for k in VARLEN) or batch.get("attention_mask", torch.ones(1, 1)).dim() != 2:
        raise FtError(
            f"{KEY}: a packed micro-batch (varlen boundaries or a 4-D mask) cannot be split over the context-parallel "
            "ranks; set data.packing: false"
        )
    ids, labels = batch["input_ids"], batch["labels"]
    rows, length = ids.shape
    extra = -length % (2 * cp)
    real = batch.get("attention_mask", torch.ones_like(ids)).bool()
    targets = F.pad(labels[:, 1:], (0, 1 + extra), value=IGNORE)  # the one shift, before the split
    # the padding added here only ever attends backwards and is never a target: any token id will do
    ids = F.pad(ids, (0, extra), value=0)
    positions = batch.get("position_ids", torch.arange(length).expand(rows, length))
    positions = torch.cat([positions, torch.arange(length, length + extra).expand(rows, extra)], dim=1)
    mine = local_positions(length + extra, rank, cp)
    local = {k: v for k, v in batch.items() if k not in SEQUENCE}
    local.update(
        input_ids=ids[:, mine],
        position_ids=positions[:, mine],
        shift_labels=targets[:, mine],
        attention_mask=torch.ones(rows, len(mine), dtype=torch.long),
    )
    if "num_tokens" in batch:
        local["num_tokens"] = int(F.pad(real, (0, extra), value=False)[:, mine].sum())
    return local


class ContextParallel:
    """A rank's place in its context-parallel group (a 1-D device mesh): splits micro-batches, and runs the forward
    and backward passes with torch's ring attention."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.size, self.rank = mesh.size(), mesh.get_local_rank()

    def local(self, batch: dict) -> dict:
        return shard(batch, self.rank, self.size)

    @contextlib.contextmanager
    def attention(self):
        """SDPA replaced by torch's ring attention for the block. ft splits the micro-batch itself (`shard`, before
        counting its tokens), so torch's context_parallel is handed a placeholder of 2·cp positions to split: its
        length turns torch's head-tail load balancing on, matching `shard`. GPU only (see `check`): the placeholder
        is made on the mesh's device type ("cuda": the rank's current device, set by runtime.start), where
        distribute_tensor(src_data_rank=None) slices it locally without a collective."""
        from torch.distributed.tensor.experimental import context_parallel

        placeholder = torch.zeros(1, 2 * self.size, device=self.mesh.device_type)
        with context_parallel(self.mesh, buffers=[placeholder], buffer_seq_dims=[1], no_restore_buffers={placeholder}):
            yield


def for_plan(plan, model, device: torch.device, summed_loss: bool) -> ContextParallel | None:
    """The rank's ContextParallel where the plan splits sequences (None where it does not); refuses, before any
    training, a job this process cannot run so (`check`, with the method section's `summed_loss`; the planner refuses
    these too, a plan.json edited by hand could still ask)."""
    cp = plan.context_parallel
    if cp <= 1:
        return None
    from finetune.models import causal_lm

    config = causal_lm(model).config
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    problems = check(
        plan.seq_len,
        cp,
        getattr(config, "_attn_implementation", None),
        False,
        plan.method,
        summed_loss=summed_loss,
        device="GPU" if device.type == "cuda" else "CPU process",
        backend=plan.backend,
        sliding_window=window,
        compile=plan.compile,
    )
    if problems:
        raise FtError("this plan cannot run: " + ". ".join(problems))
    from finetune.distributed import mesh

    # The cp sub-mesh of the job's (dp, cp, tp) mesh (the one FSDP2 and tensor parallelism use). On GPUs its groups are
    # made by torch's new_group with the default group's backends ("cpu:gloo,cuda:nccl", runtime.py), so the ring
    # attention's all-gathers of the CUDA keys and values go over NCCL.
    return ContextParallel(
        mesh.device_mesh(device.type, plan.world_size, plan.tensor_parallel, plan.context_parallel)[mesh.CP]
    )
