"""The input embeddings and the output head under FSDP2, sharded by vocabulary rows and never gathered whole.

As FSDP2 units of their own (fsdp.ends) the two tables are all-gathered whole while they run, and FSDP2 holds the
all-gather buffer and the unsharded parameter at once (torch _fsdp_collectives.foreach_all_gather_copy_out): twice
the table on every rank, 4 GiB for an 8B model with a 128k vocabulary, more than any decoder layer. Here each rank
keeps its rows of the table (a DTensor sharded on dim 0, as FSDP2 would shard it, so that optimizers, clipping,
checkpoints and `full_tensor()` see one more sharded parameter) and both passes walk the table a chunk of rows at a
time: each chunk is gathered from every rank, used, and dropped. A chunk holds at most half of a decoder layer's
parameters, so the ends never raise a rank's peak above what the layers' own all-gathers reach.

- Embeddings: every token looks up its row in the chunk that holds it (a select, no host read); the gradient of a
  trained table is accumulated per chunk and reduce-scattered to the ranks that own the rows.
- Output head: each chunk gives the logits of its vocabulary columns; the backward pass gathers the chunks again for
  the input's gradient, and reduce-scatters a trained head's row gradients. The logits are the same tensor the plain
  head gives (`plain` loss only: a chunked loss calls the head once per chunk of tokens and keeps it whole instead).
- Gradients are averaged over the ranks, as FSDP2's reduce-scatter averages them.

Used where the shapes allow it: an `nn.Embedding` (or Gemma's scaled one) and a bias-free `nn.Linear` (tied or not) on
a 1-D data-parallel mesh; other subclasses with a forward of their own, peft-wrapped ends (new tokens), tensor,
context or expert parallelism, and CPU offload keep `fsdp.ends`. The modules keep their identity (and any hooks
registered on them, peft's input-gradient hook included): their class becomes a subclass with this forward, as
fully_shard itself swaps a unit's class.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from finetune.distributed import hostmem


@dataclass(frozen=True)
class Layout:
    """How one table is split: `rows` in the whole table, `per_rank` rows on each rank (torch.chunk: the last ranks may
    hold fewer, or none), `chunk` rows of each rank's shard gathered at a time, `chunks` per pass."""

    rows: int
    per_rank: int
    chunk: int
    world: int
    group: object

    @property
    def chunks(self) -> int:
        return -(-self.per_rank // self.chunk)


def gather_rows(out: torch.Tensor, part: torch.Tensor, group, async_op: bool = False):
    """All-gather `part` from every rank into `out` (rank r's part in the r-th block of rows). On CPU (gloo) one
    broadcast per rank, in place: gloo's all-gather stages a whole second copy of the output (measured on 2 ranks: a
    64 MiB all-gather raises the peak by 65 MiB above its output, the broadcasts by 1 MiB). `async_op`: returns the
    last broadcast's Work (the others are waited for)."""
    if part.device.type != "cpu":
        return dist.all_gather_single(out, part, group=group, async_op=async_op)
    works = []
    for rank, block in enumerate(out.chunk(dist.get_world_size(group))):
        if rank == dist.get_rank(group):
            block.copy_(part)
        works.append(dist.broadcast(block, group=group, group_src=rank, async_op=True))
    for work in works[:-1] if async_op else works:
        work.wait()
    return works[-1] if async_op else None


class CpuAllGather:
    """FSDP2's all-gather for CPU units (FSDPModule.set_custom_all_gather): the broadcasts of `gather_rows` into the
    buffer FSDP2 allocates, instead of gloo's staged copy. Always returns a Work: for a synchronous all-gather in the
    forward pass FSDP2 keeps the all-gather buffer until the next unit's copy-out, to overlap the two on a GPU (torch
    _fsdp_param_group.py wait_for_unshard), a third copy of a unit on a CPU, where nothing overlaps."""

    def allocate(self, size, *, dtype, device):
        hostmem.trim()  # what the previous unit's backward freed on the heap, before this unit's buffer is mapped
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return gather_rows(output_tensor, input_tensor, group, async_op=True)


def _gathered(local: torch.Tensor, k: int, layout: Layout, dtype) -> torch.Tensor:
    """Chunk k of every rank's shard, (world, chunk, H): this rank's rows k·chunk.., zero-padded to `chunk` rows."""
    part = local.new_zeros((layout.chunk, local.shape[1]), dtype=dtype)
    rows = local[k * layout.chunk : (k + 1) * layout.chunk]
    part[: len(rows)] = rows
    out = part.new_empty((layout.world * layout.chunk, local.shape[1]))
    gather_rows(out, part, layout.group)
    return out.view(layout.world, layout.chunk, -1)


def _columns(layout: Layout, k: int, rank: int) -> tuple[int, int]:
    """The whole-table rows [a, b) that chunk k of `rank`'s shard holds (empty past the table's end)."""
    start = rank * layout.per_rank + k * layout.chunk
    end = min(start + layout.chunk, (rank + 1) * layout.per_rank, layout.rows)
    return start, max(start, end)


def _scatter_grad(parts: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Sum (world·chunk, H) row gradients over the ranks, each rank keeping its own chunk of rows, averaged."""
    out = parts.new_empty((layout.chunk, parts.shape[1]))
    dist.reduce_scatter_single(out, parts, op=dist.ReduceOp.SUM, group=layout.group)
    return out.div_(layout.world)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, local, layout: Layout, dtype, padding_idx):
        owner = torch.div(ids, layout.per_rank, rounding_mode="floor")
        within = ids - owner * layout.per_rank
        out = local.new_zeros((*ids.shape, local.shape[1]), dtype=dtype)
        for k in range(layout.chunks):
            table = _gathered(local, k, layout, dtype).view(-1, local.shape[1])
            j = within - k * layout.chunk
            hit = (j >= 0) & (j < layout.chunk)
            index = owner * layout.chunk + j.clamp(0, layout.chunk - 1)
            out = torch.where(hit.unsqueeze(-1), table[index], out)
            del table
        ctx.layout, ctx.padding_idx, ctx.rows, ctx.weight_dtype = layout, padding_idx, local.shape[0], local.dtype
        ctx.save_for_backward(ids)
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        (ids,) = ctx.saved_tensors
        layout = ctx.layout
        width = grad.shape[-1]
        g = grad.float().reshape(-1, width)
        flat = ids.reshape(-1)
        if ctx.padding_idx is not None:  # nn.Embedding: the padding row gets no gradient
            g = g * (flat != ctx.padding_idx).unsqueeze(-1)
        owner = torch.div(flat, layout.per_rank, rounding_mode="floor")
        within = flat - owner * layout.per_rank
        local = g.new_zeros((layout.chunks * layout.chunk, width))
        for k in range(layout.chunks):
            j = within - k * layout.chunk
            hit = ((j >= 0) & (j < layout.chunk)).unsqueeze(-1)
            parts = g.new_zeros((layout.world * layout.chunk, width))
            parts.index_add_(0, owner * layout.chunk + j.clamp(0, layout.chunk - 1), g * hit)
            local[k * layout.chunk : (k + 1) * layout.chunk] = _scatter_grad(parts, layout)
        return None, local[: ctx.rows].to(ctx.weight_dtype), None, None, None


class _Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, local, layout: Layout, dtype):
        x = x.to(dtype)
        out = x.new_empty((*x.shape[:-1], layout.rows))
        for k in range(layout.chunks):
            table = _gathered(local, k, layout, dtype)
            for rank in range(layout.world):
                a, b = _columns(layout, k, rank)
                if b > a:
                    out[..., a:b] = x @ table[rank, : b - a].T
            del table
        ctx.layout, ctx.dtype = layout, dtype
        ctx.save_for_backward(x, local)  # the shard is a view of the parameter: nothing is copied
        return out

    @staticmethod
    def backward(ctx, grad):
        x, shard = ctx.saved_tensors
        layout, dtype = ctx.layout, ctx.dtype
        grad = grad.to(dtype)
        trained = ctx.needs_input_grad[1]
        # summed over the chunks in fp32: a sum of bf16 partial products would round at every chunk
        grad_x = torch.zeros_like(x, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        rows = x.reshape(-1, x.shape[-1]) if trained else None
        local = x.new_zeros((layout.chunks * layout.chunk, x.shape[-1]), dtype=torch.float32) if trained else None
        for k in range(layout.chunks):
            table = _gathered(shard, k, layout, dtype) if grad_x is not None else None
            parts = x.new_zeros((layout.world, layout.chunk, x.shape[-1]), dtype=torch.float32) if trained else None
            for rank in range(layout.world):
                a, b = _columns(layout, k, rank)
                if b <= a:
                    continue
                if grad_x is not None:
                    grad_x += grad[..., a:b] @ table[rank, : b - a]
                if trained:  # in the compute dtype, as the one GEMM of an unsharded head gives it, then summed in fp32
                    parts[rank, : b - a] = grad[..., a:b].reshape(-1, b - a).T @ rows
            del table
            if trained:
                local[k * layout.chunk : (k + 1) * layout.chunk] = _scatter_grad(parts.view(-1, x.shape[-1]), layout)
        return (
            None if grad_x is None else grad_x.to(x.dtype),
            local[: len(shard)].to(shard.dtype) if trained else None,
            None,
            None,
        )


class ShardedEmbedding(torch.nn.Embedding):
    """An nn.Embedding whose weight is this rank's rows (module docstring); `layout` set by `shard`."""

    layout: Layout
    whole: torch.Tensor | None = None

    def forward(self, ids):
        if self.whole is not None:
            out = F.embedding(ids, self.whole, self.padding_idx)
        else:
            dtype = self.compute_dtype or self.weight.dtype
            out = _Lookup.apply(ids, self.weight.to_local(), self.layout, dtype, self.padding_idx)
        scale = getattr(self, "embed_scale", None)  # Gemma's ScaledWordEmbedding: the rows times sqrt(hidden)
        return out if scale is None else out * scale.to(out.dtype)


class ShardedHead(torch.nn.Linear):
    """A bias-free nn.Linear output head whose weight is this rank's vocabulary rows (module docstring)."""

    layout: Layout
    whole: torch.Tensor | None = None

    def forward(self, x):
        if self.whole is not None:
            return F.linear(x, self.whole)
        dtype = self.compute_dtype or _compute_dtype(x)
        return _Logits.apply(x, self.weight.to_local(), self.layout, dtype)


def shardable(lm, head: bool) -> list[torch.nn.Module]:
    """The ends of transformers model `lm` this module can take over: the embeddings if a plain nn.Embedding, the head
    (when `head`) if a bias-free nn.Linear; a tied pair only both together. [] when neither."""
    embeddings, output = lm.get_input_embeddings(), lm.get_output_embeddings()
    plain_embeddings = type(embeddings) is torch.nn.Embedding or _scaled(embeddings)
    plain_head = type(output) is torch.nn.Linear and output.bias is None
    tied = output is not None and output.weight is embeddings.weight
    if tied:
        return [embeddings, output] if plain_embeddings and plain_head and head else []
    return [m for m, ok in ((embeddings, plain_embeddings), (output, plain_head and head)) if ok]


def _scaled(module) -> bool:
    """Gemma's ScaledWordEmbedding (gemma, gemma3, gemma4 in transformers 5.24), whose forward is the lookup times its
    `embed_scale` buffer, which ShardedEmbedding applies."""
    return (
        isinstance(module, torch.nn.Embedding)
        and type(module).__name__.endswith("ScaledWordEmbedding")
        and isinstance(getattr(module, "embed_scale", None), torch.Tensor)
    )


def _sharded_class(module) -> type:
    """The module's class with this module's forward first (isinstance checks on the original class still hold)."""
    base = ShardedEmbedding if isinstance(module, torch.nn.Embedding) else ShardedHead
    cls = type(module)
    if cls in (torch.nn.Embedding, torch.nn.Linear):
        return base
    return type(f"Sharded{cls.__name__}", (base, cls), {})


def shard(modules: list[torch.nn.Module], mesh, budget: int, compute_dtype) -> set[torch.nn.Parameter]:
    """Make `modules` (from `shardable`) row-sharded over the 1-D `mesh`: each weight becomes a DTensor of this rank's
    rows (on the meta device when the model is, to be filled by fsdp._fill), gathered `budget` elements at most at a
    time. Returns the parameters, for fully_shard's ignored_params."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    done: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        weight = module.weight
        if id(weight) not in done:
            rows, width = weight.shape
            per_rank = -(-rows // world)
            start, end = min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)
            local = (
                torch.empty((end - start, width), dtype=weight.dtype, device="meta")
                if weight.is_meta
                else weight.detach()[start:end].clone()
            )
            dt = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
            )
            done[id(weight)] = torch.nn.Parameter(dt, requires_grad=weight.requires_grad)
            chunk = max(1, min(per_rank, budget // max(1, world * width)))
            layout = Layout(rows, per_rank, chunk, world, mesh.get_group())
        param = done[id(weight)]
        module.__class__ = _sharded_class(module)
        module.weight, module.layout, module.compute_dtype = param, layout, compute_dtype
    return set(done.values())


def sharded_ends(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, (ShardedEmbedding, ShardedHead))]


@contextlib.contextmanager
def whole(model):
    """The sharded ends gathered whole (in their compute dtype) while the block runs, for generate(): one gather per
    table instead of one pass over its chunks per decoding step."""
    ends = sharded_ends(model)
    seen: dict[int, torch.Tensor] = {}
    for m in ends:
        if id(m.weight) not in seen:
            seen[id(m.weight)] = m.weight.detach().full_tensor().to(m.compute_dtype or m.weight.dtype)
        m.whole = seen[id(m.weight)]
    try:
        yield
    finally:
        for m in ends:
            m.whole = None
