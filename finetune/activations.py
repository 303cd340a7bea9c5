"""Activation offloading (plan.activation_offload): the tensors autograd saves for the backward pass are moved to host
memory during the forward pass and brought back when the backward pass needs them.

`offloading(enabled)` is the one entry point; the loop wraps each micro-batch's forward pass in it (train.py). What is
moved, and what is not:
- weights stay where they are: a parameter, a view of one, or its autocast copy (a cast of a parameter that requires
  grad, cached by autocast for the whole forward pass) is saved by every matmul of every micro-batch, and copying it
  would move the whole model to the host and back each time while freeing nothing;
- tensors under `MIN_BYTES` stay: per-row statistics (RMSNorm's inverse norms, softmax sums) are a small share of the
  activations, and each copy has a fixed cost;
- one tensor saved by several operations (the input of q, k and v projections, or of every LoRA `A`), even through
  different views of it, moves once.
Where a layer is checkpointed, autograd saves only the layer's inputs (torch.utils.checkpoint stores nothing else in
the forward pass), and those inputs are what moves; the recomputation in the backward pass stays on the device.

On GPUs the copies go to pinned host buffers on a side stream, so they overlap the forward pass's compute, and come
back on that stream a couple of tensors ahead of the backward pass (each use waits on its copy's event). Elsewhere the
copies are plain: on the CPU the "host copy" is a separate tensor, so the same hooks run, and are tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

MIN_BYTES = 64 * 1024  # smaller saved tensors stay where they are (see the module's docstring)
PREFETCH = 2  # tensors brought back ahead of the one the backward pass asks for (GPUs)
_WEIGHT_STEPS = frozenset(  # autograd nodes that turn a parameter into what a matmul saves (cast, transpose, view)
    {
        "ToCopyBackward0",
        "TBackward0",
        "TransposeBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "PermuteBackward0",
        "ExpandBackward0",
        "AliasBackward0",
    }
)


@dataclass
class OffloadStats:
    """What one `offloading` context did: tensors and bytes moved to the host, and what it left in place."""

    moved: int = 0
    moved_bytes: int = 0
    shared: int = 0  # saves of a tensor that had already moved (moved once, used again)
    skipped_weights: int = 0
    skipped_small: int = 0
    skipped_other: int = 0  # not a plain dense tensor (sparse, meta, a tensor subclass, or an expanded view)


def offloading(enabled: bool, min_bytes: int = MIN_BYTES):
    """A context for one forward pass: saved activations go to host memory (a no-op context when not enabled).
    Entering it gives the `Offloader`, whose `stats` say what moved."""
    if not enabled:
        return contextlib.nullcontext()
    return Offloader(min_bytes)


class Offloader:
    """saved_tensors_hooks that keep saved activations in host memory until the backward pass unpacks them."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._seen: dict[tuple, tuple] = {}  # a tensor's place in memory -> (weakref to its base, version, handle)
        self._order: list[weakref.ref] = []  # handles in the order they were packed (GPU prefetch walks it backwards)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)

    def __enter__(self) -> Offloader:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._seen.clear()  # the handles now belong to the autograd graph, freed with it

    # ------------------------------------------------------------------ forward: pack
    def pack(self, t: torch.Tensor):
        reason = self._keep_reason(t)
        if reason:
            setattr(self.stats, reason, getattr(self.stats, reason) + 1)
            return t
        base = t if t._base is None else t._base  # a view keeps its base alive: while it lives, the memory is t's
        key = (id(base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is base and seen[1] == t._version:
            self.stats.shared += 1
            seen[2].uses += 1
            return seen[2]
        handle = self._copy_out(t)
        self._seen[key] = (weakref.ref(base), t._version, handle)
        self.stats.moved += 1
        self.stats.moved_bytes += nbytes(t)
        return handle

    def _keep_reason(self, t: torch.Tensor) -> str:
        """Why `t` stays where it is (a stats field), or "" when it moves."""
        if is_weight(t):
            return "skipped_weights"
        if type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_meta:
            return "skipped_other"
        if t.untyped_storage().nbytes() < nbytes(t):
            return "skipped_other"  # an expanded view: a copy would be larger than what it views
        if nbytes(t) < self.min_bytes:
            return "skipped_small"
        return ""

    def _copy_out(self, t: torch.Tensor) -> Handle:
        if t.device.type != "cuda":
            # CPU (and other devices): a plain, separate copy; on the CPU it frees nothing, but runs the same hooks
            return Handle(self, t.device, t.detach().to("cpu", copy=True))
        # pinned (page-locked) host memory: the only kind a copy from the GPU can fill asynchronously
        stream = self._side_stream(t.device)
        # on GPUs: the side stream starts after the kernel that produced `t` (wait_stream); record_stream keeps the
        # caching allocator from reusing t's memory until the copy on the side stream has read it
        stream.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t.detach(), non_blocking=True)
        t.record_stream(stream)
        handle = Handle(self, t.device, host)
        handle.order = len(self._order)
        self._order.append(weakref.ref(handle))
        return handle

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # ------------------------------------------------------------------ backward: bring back (GPU)
    def fetch(self, handle: Handle) -> torch.Tensor:
        """The device copy of `handle`, ready to use on the current stream; starts bringing back the next ones."""
        self._bring_back(handle)
        for i in range(handle.order - 1, max(handle.order - 1 - PREFETCH, -1), -1):
            ahead = self._order[i]()
            if ahead is not None:
                self._bring_back(ahead)
        current = torch.cuda.current_stream(handle.device)
        # on GPUs: the current stream waits for the host-to-device copy (its event); record_stream keeps the side
        # stream's allocator from reusing the memory while the current stream still reads it
        current.wait_event(handle.ready)
        device_copy = handle.device_copy
        device_copy.record_stream(current)
        handle.unpacked += 1
        if handle.unpacked >= handle.uses:  # its last user has it: the graph holds it while needed, no longer
            handle.device_copy, handle.unpacked = None, 0
        return device_copy

    def _bring_back(self, handle: Handle) -> None:
        if handle.device_copy is not None:
            return
        stream = self._side_stream(handle.device)
        # on GPUs: the copy to the host was queued on this same stream, so this one runs after it; the pinned host
        # buffer is not reused before the copy ends (the pinned allocator records the copy's stream)
        with torch.cuda.stream(stream):
            handle.device_copy = handle.host.to(handle.device, non_blocking=True)
            handle.ready = torch.cuda.Event()
            handle.ready.record(stream)


class Handle:
    """A saved tensor's host copy (what autograd keeps in place of the tensor), and its device copy once fetched."""

    __slots__ = ("__weakref__", "device", "device_copy", "host", "offloader", "order", "ready", "unpacked", "uses")

    def __init__(self, offloader: Offloader, device: torch.device, host: torch.Tensor):
        self.offloader, self.device, self.host = offloader, device, host
        self.device_copy, self.ready, self.order = None, None, -1
        self.uses, self.unpacked = 1, 0  # saves that share this copy; unpacks since it was last brought back


def unpack(packed):
    """The saved tensor back on its device (a tensor that never moved is returned as it is)."""
    if isinstance(packed, torch.Tensor):
        return packed
    if packed.device.type == "cuda":
        return packed.offloader.fetch(packed)
    return packed.host.to(packed.device)  # on the CPU: the host copy itself


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_weight(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or a parameter turned by casts and views into what a matmul saves (autocast's
    cached low-precision copy of a trained weight, transposed)."""
    if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
        return True
    node = t.grad_fn
    for _ in range(4):
        if node is None or type(node).__name__ not in _WEIGHT_STEPS:
            return False
        node = next((fn for fn, _ in node.next_functions if fn is not None), None)
        if isinstance(getattr(node, "variable", None), torch.nn.Parameter):  # AccumulateGrad: a leaf, here a parameter
            return True
    return False


# ---------------------------------------------------------------- selective checkpointing (plan.checkpoint_layers)
def checkpoint_only(net, count: int) -> int:
    """After activation checkpointing was enabled on every decoder layer: keep it on `count` of them, spread evenly
    over the depth (every layer saves the same activations, so which ones does not change the peak; spreading keeps
    the recomputation evenly interleaved with the backward pass), and let the others keep their activations. 0, or
    at least the number of layers, leaves every layer checkpointed (a plan.json from before checkpoint_layers existed
    says 0). Returns the number of layers that recompute.

    transformers 5.24 (modeling_layers.py, GradientCheckpointingLayer) checkpoints a layer when its own
    `gradient_checkpointing` attribute is true; a model whose layers are not such layers (older remote code checks one
    flag on the whole model) cannot checkpoint some layers only, and keeps every layer checkpointed, with a warning."""
    layers = decoder_layers(net)
    if not layers or not all(layer.gradient_checkpointing for layer in layers):
        if count:
            import logging

            logging.getLogger(__name__).warning(
                "train.checkpoint_layers: %s cannot checkpoint some layers only (its decoder layers are not "
                "transformers GradientCheckpointingLayer modules); every layer recomputes, not %d",
                type(net).__name__,
                count,
            )
        return len(layers)
    if count <= 0 or count >= len(layers):
        return len(layers)
    chosen = spread(count, len(layers))
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i in chosen
    return count


def spread(count: int, total: int) -> set[int]:
    """`count` distinct indices of range(total), evenly spaced, each in the middle of its share of the range."""
    return {(2 * i + 1) * total // (2 * count) for i in range(count)}


def decoder_layers(net) -> list:
    """The outermost transformers GradientCheckpointingLayer modules of `net`, in order (its decoder layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: list[tuple[str, object]] = []
    for name, module in net.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    return [module for _, module in found]
