"""Packing (best-fit decreasing, packed rows, efficiency) and collation, down to a tiny Llama's logits."""

from __future__ import annotations

import random

import datasets
import pytest
import torch

from finetune.data.collate import collate
from finetune.data.packing import best_fit_decreasing, efficiency, pack, padding_efficiency
from finetune.errors import DataError
from tests.helpers import make_examples, tiny_llama


def random_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def naive_bfd(lengths, capacity):
    """Reference best-fit decreasing by linear scan (same tie rules)."""
    rooms, bins = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b, room in enumerate(rooms) if room >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
        else:
            b = len(bins)
            rooms.append(capacity)
            bins.append([])
        rooms[b] -= lengths[i]
        bins[b].append(i)
    return [sorted(b) for b in bins]


def first_fit(lengths, capacity):
    rooms = []
    for n in lengths:
        for b, room in enumerate(rooms):
            if room >= n:
                rooms[b] -= n
                break
        else:
            rooms.append(capacity - n)
    return len(rooms)


# ------------------------------------------------------------------ best fit decreasing
@pytest.mark.parametrize(
    "seed,lo,hi,capacity", [(0, 10, 500, 512), (1, 1, 64, 64), (2, 100, 100, 300), (3, 1, 2048, 2048)]
)
def test_bins_respect_capacity_and_hold_each_index_once(seed, lo, hi, capacity):
    lengths = random_lengths(700, lo, hi, seed)
    bins = best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


@pytest.mark.parametrize("seed", range(5))
def test_bfd_equals_reference_scan(seed):
    lengths = random_lengths(300, 1, 200, seed)
    assert best_fit_decreasing(lengths, 256) == naive_bfd(lengths, 256)


def test_bfd_packs_tightly_and_beats_first_fit():
    lengths = random_lengths(2000, 10, 500, seed=7)
    bins = best_fit_decreasing(lengths, 512)
    assert sum(lengths) / (len(bins) * 512) >= 0.95
    assert len(bins) < first_fit(lengths, 512)


def test_bfd_is_deterministic_with_ties():
    lengths = [5, 3, 5, 3, 2, 2, 8, 1] * 20
    first = best_fit_decreasing(lengths, 10)
    assert all(best_fit_decreasing(list(lengths), 10) == first for _ in range(3))
    assert best_fit_decreasing([4, 4, 4], 8) == [[0, 1], [2]]


def test_bfd_rejects_examples_that_do_not_fit():
    with pytest.raises(DataError, match="example 1 has 9 tokens"):
        best_fit_decreasing([3, 9], 8)
    with pytest.raises(DataError, match="example 0 has 0 tokens"):
        best_fit_decreasing([0], 8)
    assert best_fit_decreasing([], 8) == []


# ------------------------------------------------------------------ pack
def test_pack_rows_keep_examples_whole_and_mark_boundaries():
    examples = make_examples(random_lengths(60, 1, 40, seed=3), seed=3)
    packed = pack(datasets.Dataset.from_list(examples), seq_len=64)
    assert packed.column_names == ["input_ids", "labels", "position_ids", "seq_lens"]
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], 64)
    assert len(packed) == len(bins)
    for row, members in zip(packed, bins):
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == sum(row["seq_lens"]) <= 64
        start = 0
        for i, n in zip(members, row["seq_lens"]):
            example = examples[i]
            assert n == len(example["input_ids"])
            assert row["input_ids"][start : start + n] == example["input_ids"]
            assert row["position_ids"][start : start + n] == list(range(n))
            assert row["labels"][start] == -100
            assert row["labels"][start + 1 : start + n] == example["labels"][1:]
            start += n


def test_pack_reads_through_shuffles_and_handles_empty_data():
    ds = datasets.Dataset.from_list(make_examples([2, 1, 3, 2, 1, 3])).shuffle(seed=0).select([0, 2, 4])
    packed = pack(ds, 4)
    assert sorted(t for row in packed["input_ids"] for t in row) == sorted(t for e in ds["input_ids"] for t in e)
    empty = pack(ds.select([]), 4)
    assert len(empty) == 0 and empty.column_names == ["input_ids", "labels", "position_ids", "seq_lens"]
    assert efficiency(empty, 4, packed=True) == 0.0


def test_pack_rejects_mismatched_labels():
    ds = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(DataError, match="differ in length"):
        pack(ds, 8)


def test_efficiency_of_packed_and_unpacked_rows():
    lengths = [3, 5, 2, 7, 4]
    ds = datasets.Dataset.from_list(make_examples(lengths))
    assert efficiency(ds, 10, packed=False) == pytest.approx(21 / 50)
    packed = pack(ds, 10)
    assert efficiency(packed, 10, packed=True) == pytest.approx(21 / (len(packed) * 10))
    with pytest.raises(DataError, match="packed=True"):
        efficiency(ds, 10, packed=True)
    with pytest.raises(DataError, match="seq_len"):
        efficiency(ds, 6, packed=False)


def test_padding_efficiency():
    assert padding_efficiency([3, 5, 2, 7, 4], 2) == pytest.approx(21 / (10 + 14 + 4))
    assert padding_efficiency([4, 4, 4], 3) == 1.0
    assert padding_efficiency([], 4) == 0.0


# ------------------------------------------------------------------ collate
def test_collate_pads_unpacked_rows():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    out = collate(rows, pad_id=0, attn_implementation="sdpa", pad_to_multiple_of=4)
    assert set(out) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]


def test_collate_packed_mask_keeps_examples_apart():
    rows = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, -100], "position_ids": [0, 1, 0], "seq_lens": [2, 1]},
        {"input_ids": [4, 5], "labels": [-100, 5], "position_ids": [0, 1], "seq_lens": [2]},
    ]
    out = collate(rows, pad_id=0, attn_implementation="eager", mask_dtype=torch.bfloat16)
    mask = out["attention_mask"]
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == torch.bfloat16
    allowed = (mask[:, 0] == 0).int().tolist()
    assert allowed[0] == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert allowed[1] == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]  # the padding query sees only itself
    assert mask.min().item() == torch.finfo(torch.bfloat16).min
    assert out["position_ids"].tolist() == [[0, 1, 0], [0, 1, 0]]


def test_collate_packed_flash_is_one_padding_free_row():
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    rows = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, -100], "position_ids": [0, 1, 0], "seq_lens": [2, 1]},
        {"input_ids": [4, 5], "labels": [-100, 5], "position_ids": [0, 1], "seq_lens": [2]},
    ]
    out = collate(rows, pad_id=0, attn_implementation="flash_attention_2", pad_to_multiple_of=4)
    assert set(out) == {
        "input_ids",
        "labels",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
    }
    assert out["cu_seq_lens_q"].tolist() == [0, 2, 3, 5, 8] and out["max_length_q"] == 3
    assert out["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, 2, -100, -100, 5, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 0, 1, 0, 1, 2]]
    (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(out["position_ids"])
    assert cu_seqlens.tolist() == [0, 2, 3, 5, 8]  # each example (and the padding) its own sequence


def test_collate_rejects_bad_batches():
    packed = {"input_ids": [1, 2], "labels": [1, 2], "seq_lens": [2]}
    plain = {"input_ids": [1, 2], "labels": [1, 2]}
    with pytest.raises(DataError, match="mixes"):
        collate([packed, plain], 0, "sdpa")
    with pytest.raises(DataError, match="flex_attention"):
        collate([packed], 0, "flex_attention")
    with pytest.raises(DataError, match="seq_lens sum to 3"):
        collate([{**packed, "seq_lens": [3]}], 0, "sdpa")
    with pytest.raises(DataError, match="empty"):
        collate([], 0, "sdpa")


# ------------------------------------------------------------------ a tiny Llama agrees
def test_collated_batch_is_padded(packed_rows):
    _, rows = packed_rows
    batch = collate(rows, pad_id=0, attn_implementation="sdpa", pad_to_multiple_of=16)
    lens = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == (2, 32) and min(lens) < max(lens) <= 32


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_separate_runs(attn, packed_rows):
    examples, rows = packed_rows
    model = tiny_llama(attn)
    batch = collate(rows, pad_id=0, attn_implementation=attn, pad_to_multiple_of=16)
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], 32)
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
        leaky = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=torch.ones_like(batch["input_ids"]),
        ).logits
        for r, (row, members) in enumerate(zip(rows, bins)):
            start = 0
            for i, n in zip(members, row["seq_lens"]):
                alone = model(input_ids=torch.tensor([examples[i]["input_ids"]])).logits[0]
                torch.testing.assert_close(packed[r, start : start + n], alone, atol=1e-5, rtol=1e-5)
                start += n
    assert not torch.allclose(packed[0, :31], leaky[0, :31], atol=1e-3)  # the check can see leaks


def test_sdpa_varlen_packed_logits_equal_separate_runs(packed_rows):
    from finetune.attention import register

    examples, rows = packed_rows
    register()
    model = tiny_llama("sdpa_varlen")
    batch = collate(rows, pad_id=0, attn_implementation="sdpa_varlen")
    assert batch["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows))  # no padding at all
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], 32)
    with torch.no_grad():
        packed = model(**inputs).logits[0]
        start = 0
        for row, members in zip(rows, bins):
            for i, n in zip(members, row["seq_lens"]):
                alone = model(input_ids=torch.tensor([examples[i]["input_ids"]])).logits[0]
                torch.testing.assert_close(packed[start : start + n], alone, atol=1e-5, rtol=1e-5)
                start += n


def test_packed_loss_is_token_weighted_mean_of_example_losses(packed_rows):
    examples, rows = packed_rows
    model = tiny_llama("sdpa")
    bins = best_fit_decreasing([len(e["input_ids"]) for e in examples], 32)
    row, members = rows[0], bins[0]
    batch = collate([row], pad_id=0, attn_implementation="sdpa", pad_to_multiple_of=16)
    with torch.no_grad():
        packed_loss = model(**batch).loss
        total, count = 0.0, 0
        for i in members:
            labels = torch.tensor([examples[i]["labels"]])
            n = int((labels[0, 1:] != -100).sum())
            if n:
                total += model(input_ids=torch.tensor([examples[i]["input_ids"]]), labels=labels).loss.item() * n
                count += n
    assert count > 0
    assert packed_loss.item() == pytest.approx(total / count, abs=1e-5)
