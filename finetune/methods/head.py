"""Next-token losses and log-probabilities of a batch: the output head and the cross-entropy, as the plan says.

`plain` materialises the logits (positions × vocabulary) at once: in the compute dtype, their fp32 copy and the
gradients of both, about t·V·(a+8) bytes. For a summed loss (SFT) over a micro-batch of one row (packed rows,
concatenated: methods/sft.py) it asks the model for the logits of the trained positions only: a prompt's positions
predict nothing the loss reads, and on instruction data they are most of a row. The model's own forward takes them
(transformers' `logits_to_keep` as a tensor of positions: the hidden states are sliced before its head), so its head
and whatever it does to the logits (a scale, a softcap) run as always, and a sharded head (FSDP2, ZeRO-3) is called as
the engine schedules it. The positions come from the host (`host_inputs`, built from the collated labels before the
batch moves), so that selecting them never waits for the device. Rows split over context- or tensor-parallel ranks,
padded micro-batches of several rows and per-token log-probabilities run the head over every position. The others
ask the model for the logits of one position only (`logits_to_keep=1`) and take the final hidden states from its
decoder's output (a forward hook, removed after the call); untrained positions (labels IGNORE) contribute nothing
and are dropped first.
- `chunked` (pure torch, any device) runs the head MODULE and the fp32 cross-entropy over `chunk_tokens` trained
  tokens at a time inside activation checkpointing: one chunk's logits exist at a time, in the forward pass and
  again when the backward pass recomputes them. Calling the module (not its weight) keeps FSDP2 / ZeRO-3 hooks working.
- `liger` (liger-kernel) and `cut_cross_entropy` (Apple's cut-cross-entropy) hand the hidden states and the head's
  weight to fused GPU kernels; they need the weight whole on the rank (one process, DDP, FSDP2; not ZeRO-3). Liger's
  kernel computes its gradients during the forward pass for a summed loss, so ft uses it for a summed loss (SFT) only.
Every implementation agrees with `plain` (tests/test_chunked_loss.py); a model whose logits are not the plain head of
the final hidden state (a scale after the head, say) is refused on its first batch rather than trained wrongly; a
logit softcap (config.final_logit_softcapping: Gemma 2) is applied as the model applies it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from finetune.data.masking import IGNORE
from finetune.errors import FtError
from finetune.methods.loss import MODEL_INPUTS
from finetune.models import causal_lm

PACKAGES = {"liger": ("liger_kernel", "liger-kernel"), "cut_cross_entropy": ("cut_cross_entropy", "cut-cross-entropy")}
IMPLEMENTATIONS = ("plain", "chunked", *PACKAGES)
_KEY = "train.loss_implementation"
POSITIONS = "trained_positions"  # a micro-batch's key: the positions whose next token is trained (`trained_positions`)


@dataclass(frozen=True)
class Head:
    """The model's output head (the module, so that FSDP2 / ZeRO-3 hooks run) and its logit softcap, if any."""

    module: torch.nn.Module
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of `hidden`, softcapped as the model does (cap · tanh(logits / cap))."""
        return self.capped(self.module(hidden))

    def capped(self, raw: torch.Tensor) -> torch.Tensor:
        """The head's output in fp32, softcapped as the model does."""
        logits = raw.float()
        return logits if self.softcap is None else self.softcap * torch.tanh(logits / self.softcap)


class LossHead:
    """Computes what the methods need from the logits, never holding more of them than `implementation` allows."""

    def __init__(self, implementation: str = "plain", chunk_tokens: int = 0, rows: int = 0, whole_rows: bool = True):
        """`rows`: the most positions a micro-batch is expected to have (the plan's micro-batch of seq_len tokens),
        from which ZeRO-3 counts its chunks (`chunk_count`). `whole_rows`: each rank holds its micro-batches' rows
        whole (False under context parallelism, and under tensor parallelism, whose sequence-parallel regions split
        them), so that the plain loss may ask for their trained positions only."""
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"unknown loss implementation {implementation!r} (known: {', '.join(IMPLEMENTATIONS)})")
        if implementation == "chunked" and chunk_tokens < 1:
            raise ValueError("a chunked loss needs chunk_tokens >= 1 (plan.loss_chunk_tokens)")
        self.implementation, self.chunk_tokens = implementation, chunk_tokens
        self.calls = -(-rows // chunk_tokens) if implementation == "chunked" else 0  # the head's calls per micro-batch
        self._selects = implementation == "plain" and whole_rows  # the plain loss may ask for trained positions only
        self._checked = weakref.WeakSet()  # models whose logits were compared with head(hidden) once

    def host_inputs(self, batch: dict) -> dict:
        """What `summed_nll` reads from a collated micro-batch, computed from its host tensors before the batch moves to
        the device: for a micro-batch of one row (methods/sft.py: packed rows, concatenated), the positions whose next
        token is trained (`trained_positions`); nothing for several rows or where the plain loss does not select."""
        if not self._selects or batch["labels"].shape[0] != 1:
            return {}
        return {POSITIONS: trained_positions(batch["labels"])}

    def summed_nll(self, model, batch: dict) -> torch.Tensor:
        """Sum of the next-token cross-entropy (fp32) over the trained tokens of the batch."""
        if self.implementation == "plain":
            inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
            # the labels shifted left (the last position predicts nothing), not the logits: no copy of t·V values
            targets = next_tokens(batch)
            if POSITIONS in batch and takes_positions(type(causal_lm(model))):  # the trained positions' logits only
                keep = batch[POSITIONS].to(targets.device)
                logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits
                targets = targets.index_select(-1, keep)
            else:
                logits = model(**inputs, use_cache=False).logits
            targets = targets.to(logits.device)
            return F.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
            )
        with self._hidden(model, batch) as (hidden, targets, mask, head):
            if self.implementation == "chunked":
                return sum(self._chunks(_chunk_nll, head, hidden[mask], targets[mask]))
            return fused_nll(self.implementation, head, hidden, targets, "sum")

    def token_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities (fp32) of the next tokens, (B, T-1), 0 where untrained, and the mask of trained ones."""
        if self.implementation == "plain":
            inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
            logits = model(**inputs, use_cache=False).logits[:, :-1, :].float()
            targets = batch["labels"][:, 1:].to(logits.device)
            mask = targets != IGNORE
            logps = -F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.clamp(min=0).reshape(-1), reduction="none"
            ).view_as(targets)
            return logps * mask, mask
        with self._hidden(model, batch) as (hidden, targets, mask, head):
            if self.implementation == "chunked":
                values = torch.cat(self._chunks(_chunk_logps, head, hidden[mask], targets[mask]))
                return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(
                    mask, values
                ), mask
            return -fused_nll(self.implementation, head, hidden, targets, "none").view_as(targets) * mask, mask

    @contextlib.contextmanager
    def _hidden(self, model, batch: dict):
        """The final hidden states of the positions that predict a next token (B, T-1, H), their targets, the mask
        of trained ones and the output head, with the head's parameters whole on this rank while the block runs."""
        lm = causal_lm(model)
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        head = Head(lm.get_output_embeddings(), getattr(lm.config, "final_logit_softcapping", None))
        check = lm not in self._checked
        hidden, logits, calls = final_hidden(model, lm, inputs, head.module if check else None)
        shifted = "shift_labels" in batch  # every position has its target (context parallelism: distributed/cp.py)
        targets = (batch["shift_labels"] if shifted else batch["labels"][:, 1:]).to(hidden.device)
        with whole_head(lm, head.module):
            if check:
                check_head(self.implementation, head, hidden, logits, calls)
                self._checked.add(lm)
            yield (hidden if shifted else hidden[:, :-1]), targets, targets != IGNORE, head

    def _chunks(self, fn, head, hidden: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """fn(head, hidden, targets) over `chunk_tokens` rows at a time (at least once, so that an empty batch still
        reaches every parameter), each recomputed in the backward pass instead of keeping its logits."""
        out = []
        self.calls = chunk_count(head, len(targets), self.chunk_tokens, self.calls)
        for i in range(self.calls):
            rows = slice(i * self.chunk_tokens, (i + 1) * self.chunk_tokens)  # past the end: empty, still one call
            if torch.is_grad_enabled():
                out.append(
                    checkpoint(fn, head, hidden[rows], targets[rows], use_reentrant=False, preserve_rng_state=False)
                )
            else:
                out.append(fn(head, hidden[rows], targets[rows]))
        return out


def next_tokens(batch: dict) -> torch.Tensor:
    """The target of every position (B, T): the labels shifted left, IGNORE at the end; or the batch's `shift_labels`,
    already shifted over the whole sequence before it was split over context-parallel ranks (distributed/cp.py)."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return F.pad(batch["labels"][..., 1:], (0, 1), value=IGNORE)


def trained_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions of a one-row micro-batch whose next token is trained: from the collated labels on the host (on the
    device, sizing the result would read it)."""
    return (next_tokens({"labels": labels})[0] != IGNORE).nonzero().view(-1)


@functools.cache
def takes_positions(cls: type) -> bool:
    """Whether the model class's forward takes `logits_to_keep` (transformers' causal LMs: an int, or a tensor of the
    positions to compute logits for, modeling_utils.slice_logits_to_keep)."""
    import inspect

    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def chunk_count(head: Head, rows: int, chunk_tokens: int, job: int = 1) -> int:
    """How many chunks: enough for `rows`, at least one. Under ZeRO-3 the job's count: at least `job` (the plan's
    micro-batch, or the most an earlier call needed), and the most any rank needs. DeepSpeed all-gathers the head's
    partitioned parameters at every call of the module, and again where the backward pass recomputes it (deepspeed
    0.19 runtime/zero/parameter_offload.py, pre_sub_module_forward_function): every rank must call it as often. And it
    records the order of the sub-modules called from one forward pass of the model to the next (reset_step at each,
    parameter_offload.py:303-306); a pass that calls them otherwise (the head a different number of times) invalidates
    that trace (partitioned_param_coordinator.py:202-219, trace_prologue), after which each call gathers its module
    again and releases it (release_sub_module, :498-499) instead of keeping the head gathered for the calls that follow
    (__params_to_release, :656-662) and prefetching by the trace. The agreement is one all-reduce of a CPU scalar
    (ft's process group: cpu:gloo,cuda:nccl)."""
    count = max(-(-rows // chunk_tokens), 1)
    if any(hasattr(p, "ds_id") for p in head.module.parameters()) and torch.distributed.is_initialized():
        agreed = torch.tensor([max(count, job)])
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        count = int(agreed)
    return count


def _chunk_nll(head: Head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head.logits(hidden), targets, reduction="sum")


def _chunk_logps(head: Head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(head.logits(hidden), targets, reduction="none")


def loss_head(plan, per_token: bool) -> LossHead:
    """The head for the plan's loss implementation; refuses, before any training, one that cannot serve the method
    (`per_token`: it needs per-token log-probabilities with their gradients) or this job."""
    implementation = plan.loss_implementation
    if implementation in PACKAGES:
        module, package = PACKAGES[implementation]
        fix = f"or set {_KEY}: chunked (pure torch, any device)"
        if plan.device != "GPU":
            raise FtError(f"{_KEY}: {implementation} runs fused CUDA kernels, and this job runs on CPUs; {fix}")
        if importlib.util.find_spec(module) is None:
            raise FtError(
                f"{_KEY}: {implementation} needs the {package} package, not installed: pip install {package}, {fix}"
            )
        if plan.backend == "deepspeed" and plan.sharding == "zero3":
            raise FtError(
                f"{_KEY}: {implementation} needs the output head's weight whole on each rank, and DeepSpeed ZeRO-3 "
                f"partitions it; {fix}, or use distributed.sharding: zero2 or distributed.backend: fsdp"
            )
        if implementation == "liger" and per_token:
            raise FtError(
                f"{_KEY}: ft uses liger's fused kernel for a summed loss (sft) only; this method needs per-token "
                f"log-probabilities with their gradients: set {_KEY}: cut_cross_entropy or chunked"
            )
    if implementation != "chunked":
        # no rank holds part of a row's positions
        whole = getattr(plan, "context_parallel", 1) == 1 and getattr(plan, "tensor_parallel", 1) == 1
        return LossHead(implementation, plan.loss_chunk_tokens, whole_rows=whole)
    return LossHead(implementation, plan.loss_chunk_tokens, plan.micro_batch_size * plan.seq_len)


def final_hidden(model, lm, inputs: dict, head=None) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One forward pass through the (wrapped) model, its head run on the last position only; returns the decoder's
    output (the final normed hidden states, what the head reads), those logits, and each call of the `head` module in
    the pass as (input, output) (none recorded without `head`). The forward goes through the outermost wrapper so
    that DDP, FSDP2 and DeepSpeed see it as they see any forward."""
    seen, calls = [], []
    hooks = [lm.get_decoder().register_forward_hook(lambda module, args, output: seen.append(output[0]))]
    if head is not None:
        hooks.append(head.register_forward_hook(lambda module, args, output: calls.append((args[0], output))))
    try:
        logits = model(**inputs, use_cache=False, logits_to_keep=1).logits
    finally:
        for hook in hooks:
            hook.remove()
    if len(seen) != 1 or logits.shape[-2] != 1:
        raise FtError(
            f"{_KEY}: {type(lm).__name__} does not compute its logits from one pass of its decoder with "
            f"logits_to_keep, which ft's {_KEY} other than plain need; set {_KEY}: plain"
        )
    return seen[0], logits, calls


def check_head(implementation: str, head: Head, hidden: torch.Tensor, logits: torch.Tensor, calls: list) -> None:
    """The model's own logits of the last position must be its output head (and softcap) applied to the hidden state:
    otherwise something (a scale, say) comes between them, which computing the head here would leave out. Read from
    the head's one call in the model's forward pass (`calls`, final_hidden), not from a call of its own: under ZeRO-3
    an extra call in the first batch would change the order of module calls DeepSpeed traces (`chunk_count`)."""
    with torch.no_grad():
        fits = len(calls) == 1 and calls[0][0].shape == hidden[:, -1:].shape
        if fits:
            x, raw = calls[0]
            ours = head.capped(raw)
            fits = torch.allclose(x.float(), hidden[:, -1:].float(), rtol=1e-3, atol=1e-5)
            fits = fits and ours.shape == logits.shape and torch.allclose(ours, logits.float(), rtol=1e-2, atol=1e-2)
    if not fits:
        raise FtError(
            f"{_KEY}: {implementation} computes the logits as the model's output head applied to the final hidden "
            f"state, but this model transforms them further (a scale, say); set {_KEY}: plain"
        )


@contextlib.contextmanager
def whole_head(lm, head):
    """Keep the head's parameters whole while the head runs outside the model's forward. FSDP2 (`fully_shard` on
    the transformers model, distributed/fsdp.py) reshards its root unit, which holds the head, after the forward
    when reshard_after_forward is true: it is all-gathered again here (FSDPModule.unshard), and stays whole through
    the backward pass, whose recomputed chunks read it, until the root's post-backward reduce-scatters its gradients
    and reshards it (torch 2.13 distributed/fsdp/_fully_shard/_fsdp_state.py, _root_post_backward_final_callback).
    Without a backward pass to come (no grad) it is resharded here. Other models: nothing to do. On GPUs unshard()
    waits for its all-gather (async_op false) before the head runs on the compute stream."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    unit = head if isinstance(head, FSDPModule) else lm  # the head's own unit (plain loss only: fsdp.ends), or the root
    sharded = isinstance(unit, FSDPModule) and any(isinstance(p, DTensor) for p in head.parameters())
    if sharded:
        unit.unshard()
    try:
        yield
    finally:
        if sharded and not torch.is_grad_enabled():
            unit.reshard()


def fused_nll(implementation: str, head: Head, hidden: torch.Tensor, targets: torch.Tensor, reduction: str):
    """Next-token cross-entropy from a fused kernel: summed ("sum") or per position ("none", 0 where untrained)."""
    if type(head.module) is not torch.nn.Linear:
        raise FtError(
            f"{_KEY}: {implementation} needs the output head to be a plain linear layer, but it is "
            f"{type(head.module).__name__} (an adapter or a wrapper on it); set {_KEY}: chunked"
        )
    weight, bias, cap = head.module.weight, head.module.bias, head.softcap
    from torch.distributed.tensor import DTensor

    if hasattr(weight, "ds_id") or isinstance(weight, DTensor):  # a ZeRO-3 partition, an FSDP2 shard
        raise FtError(
            f"{_KEY}: {implementation} needs the output head's weight whole on this rank; set {_KEY}: chunked"
        )
    flat, goal = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if implementation == "liger":
        if reduction != "sum":  # its gradients are computed in the forward pass, for a summed loss (see loss_head)
            raise ValueError("ft uses liger's fused linear cross-entropy for a summed loss only")
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        # GPU only. Its autograd Function runs under the caller's autocast (liger ops/utils.py amp_custom_fwd): the
        # matmuls in the autocast dtype, the weight's gradient accumulated in the weight's own dtype.

        return liger_fused_linear_cross_entropy(
            flat, weight, goal, bias=bias, ignore_index=IGNORE, reduction=reduction, softcap=cap
        )
    from cut_cross_entropy import linear_cross_entropy

    if torch.is_autocast_enabled(flat.device.type):  # the kernel multiplies operands of one dtype, as autocast would
        dtype = torch.get_autocast_dtype(flat.device.type)
        flat, weight = flat.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    else:
        weight = weight.to(flat.dtype)
    return linear_cross_entropy(flat, weight, goal, bias=bias, ignore_index=IGNORE, softcap=cap, reduction=reduction)
