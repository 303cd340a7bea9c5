"""Packing: several tokenized examples share one row of at most `seq_len` tokens.

Rows come in as `{"input_ids": [...], "labels": [...]}` (labels -100 where not trained), each at most
`seq_len` long. `best_fit_decreasing` groups example indices into bins; `pack` turns each bin into one
row that carries what the collator needs to keep examples apart: `position_ids` restarting at 0 for
every example and `seq_lens`, the example lengths in order. Rows are not padded here.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Sequence

import numpy as np

from finetune.data.masking import IGNORE
from finetune.errors import DataError


class _RoomIndex:
    """Open bins keyed by remaining room (an integer in 0..capacity).

    A Fenwick tree counts bins per room value, so "the smallest room >= n" costs O(log capacity);
    a heap per room value hands out the lowest bin id first, which makes ties deterministic.
    """

    def __init__(self, capacity: int):
        self.size = capacity + 1
        self.tree = [0] * (self.size + 1)
        self.bins: dict[int, list[int]] = {}
        self.top = 1 << (self.size.bit_length() - 1)

    def _add(self, room: int, delta: int) -> None:
        i = room + 1
        while i <= self.size:
            self.tree[i] += delta
            i += i & -i

    def _count_below(self, room: int) -> int:
        """Number of open bins whose room is < room."""
        total, i = 0, room
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def push(self, room: int, bin_id: int) -> None:
        heapq.heappush(self.bins.setdefault(room, []), bin_id)
        self._add(room, 1)

    def pop_tightest(self, need: int) -> tuple[int, int] | None:
        """Remove and return (room, bin_id) of the bin with the least room >= need, or None."""
        target = self._count_below(need) + 1  # rank of the first bin with room >= need
        pos, remaining, step = 0, target, self.top
        while step:  # binary lifting: largest pos with prefix(pos) < target
            nxt = pos + step
            if nxt <= self.size and self.tree[nxt] < remaining:
                pos, remaining = nxt, remaining - self.tree[nxt]
            step >>= 1
        if pos >= self.size:
            return None
        room = pos  # tree index pos + 1 holds room value pos
        bin_id = heapq.heappop(self.bins[room])
        self._add(room, -1)
        return room, bin_id


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group example indices into bins whose total length is at most `capacity`.

    Examples are taken longest first (ties: lower index first); each goes into the open bin with the
    least room that still fits it (ties: the bin opened first), or opens a new bin. O(n log n).
    Never splits an example. Bins are returned in the order they were opened, each bin's indices in
    ascending order.
    """
    if capacity < 1:
        raise DataError(f"packing capacity must be at least 1 token, got {capacity}")
    for i, n in enumerate(lengths):
        if n < 1 or n > capacity:
            raise DataError(
                f"example {i} has {n} tokens; packing needs 1..{capacity} "
                f"(truncate or drop longer examples before packing)"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rooms = _RoomIndex(capacity)
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        found = rooms.pop_tightest(n)
        if found is None:
            room, bin_id = capacity, len(bins)
            bins.append([])
        else:
            room, bin_id = found
        bins[bin_id].append(i)
        rooms.push(room - n, bin_id)
    return [sorted(b) for b in bins]


def _list_column(table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, per-row lengths) of a list-of-int column of an Arrow table."""
    import pyarrow.compute as pc

    if name not in table.column_names:
        raise DataError(f"tokenized rows need an {name!r} column; found {table.column_names}")
    column = table.column(name).combine_chunks()
    if column.null_count:
        raise DataError(f"column {name!r} has {column.null_count} missing value(s)")
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    return column.flatten().to_numpy(zero_copy_only=False), lengths.astype(np.int64)


def example_lengths(ds) -> list[int]:
    """Token count of each row of a tokenized dataset, read in Arrow batches (no Python lists)."""
    out: list[int] = []
    for batch in ds.with_format("arrow").iter(batch_size=10_000):
        out.extend(_list_column(batch, "input_ids")[1].tolist())
    return out


def _pack_batch(bins: dict, source) -> dict:
    """datasets.map function: one batch of bins -> one batch of packed rows."""
    flat = [i for b in bins["example_ids"] for i in b]
    table = source.with_format("arrow")[flat]
    ids, lengths = _list_column(table, "input_ids")
    labels, label_lengths = _list_column(table, "labels")
    if not np.array_equal(lengths, label_lengths):
        bad = flat[int(np.argmax(lengths != label_lengths))]
        raise DataError(f"example {bad}: input_ids and labels differ in length")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    # Causal-LM losses shift labels by one: position t is trained to predict labels[t + 1]. In a
    # packed row the last token of one example is followed by the first token of the next, so that
    # position would be trained to predict an unrelated example's opening token from context it
    # cannot see. Masking the label of every example's first token removes exactly that target;
    # an example's first label is never a target of the example itself, so nothing else changes.
    labels = labels.astype(np.int64, copy=True)
    labels[starts] = IGNORE  # every example has at least one token (best_fit_decreasing checks)
    positions = np.arange(len(ids), dtype=np.int64) - np.repeat(starts, lengths)
    out = {"input_ids": [], "labels": [], "position_ids": [], "seq_lens": []}
    images = table.column("images").to_pylist() if "images" in table.column_names else None
    if images is not None:
        out["images"] = []
    cursor = 0
    for b in bins["example_ids"]:
        first, last = cursor, cursor + len(b)
        lo, hi = int(starts[first]), int(starts[last - 1] + lengths[last - 1])
        out["input_ids"].append(ids[lo:hi])
        out["labels"].append(labels[lo:hi])
        out["position_ids"].append(positions[lo:hi])
        out["seq_lens"].append(lengths[first:last])
        if images is not None:  # a vision-language model's rows: their images in the order of their tokens
            out["images"].append([p for k in range(first, last) for p in images[k] or ()])
        cursor = last
    return out


def pack(ds, seq_len: int, batch_size: int = 1000):
    """One row per bin of `best_fit_decreasing`: input_ids and labels concatenated (each example's
    first label set to -100), position_ids restarting at 0 per example, seq_lens. Not padded.

    Only input_ids and labels are kept (and a vision-language model's `images`, concatenated in example order); other
    columns are dropped. Rows come out in bin order (longest examples first), so the training sampler must shuffle
    them.
    """
    import datasets

    bins = best_fit_decreasing(example_lengths(ds), seq_len)
    ints = datasets.List(datasets.Value("int64"))
    features = datasets.Features({"input_ids": ints, "labels": ints, "position_ids": ints, "seq_lens": ints})
    if "images" in ds.column_names:
        features["images"] = datasets.List(datasets.Value("string"))
    digest = hashlib.sha256(repr((seq_len, len(ds), bins)).encode()).hexdigest()[:16]
    if not bins:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features)
    bin_ds = datasets.Dataset.from_dict({"example_ids": bins}, features=datasets.Features({"example_ids": ints}))
    # new_fingerprint is given so that datasets does not hash (pickle) the source dataset.
    return bin_ds.map(
        _pack_batch,
        batched=True,
        batch_size=batch_size,
        fn_kwargs={"source": ds},
        remove_columns=["example_ids"],
        features=features,
        new_fingerprint=f"ft-pack-{digest}",
        desc="packing",
    )


def efficiency(ds, seq_len: int, packed: bool) -> float:
    """Real tokens / token slots, with every row counted as `seq_len` slots.

    For unpacked data this assumes padding to seq_len (padding each batch to its longest row is the
    collator's business; `padding_efficiency` estimates that case). `packed` must match the data:
    packed rows carry a `seq_lens` column.
    """
    if packed != ("seq_lens" in ds.column_names):
        given = "unpacked rows (no seq_lens column)" if packed else "packed rows (with seq_lens)"
        raise DataError(f"efficiency(packed={packed}) was given {given}; pass packed={not packed}")
    lengths = example_lengths(ds)
    if not lengths:
        return 0.0
    if max(lengths) > seq_len:
        raise DataError(f"a row has {max(lengths)} tokens, more than seq_len={seq_len}")
    return sum(lengths) / (len(lengths) * seq_len)


def padding_efficiency(lengths: Sequence[int], batch_size: int) -> float:
    """Real tokens / slots when consecutive batches of `batch_size` are each padded to their longest row."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    slots = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        slots += len(batch) * max(batch)
    return sum(lengths) / slots if slots else 0.0
